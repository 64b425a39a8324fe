"""Config builders shared by the trainer tests (tiny model, synthetic task, no gateway)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sisrl.trainer.config import TrainConfig, config_from_dict


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def synthetic_config(run_dir: Path, **sections: Any) -> TrainConfig:
    """The tiny 2-layer Llama on the synthetic token task: 4 prompts x 8 samples, 6 tokens, K = 8."""
    base: dict[str, Any] = {
        "run_dir": str(run_dir), "seed": 0, "total_steps": 12, "checkpoint_every": 1000, "tensorboard": False,
        "progress": False, "device": "cpu",
        "model": {"path": "tiny"},
        "rollout": {"source": "synthetic", "prompts_per_step": 4, "samples_per_prompt": 8,
                    "synthetic_response_len": 6, "synthetic_target_frac": 0.25, "temperature": 1.0},
        "algorithm": {"loss": "grpo", "ratio": "sis", "logprobs_k": 8, "staleness": 4},
        "optim": {"lr": 3e-2, "grad_clip": 1.0},
    }
    return config_from_dict(_merge(base, sections))



def train_side_by_side(configs: list[TrainConfig]) -> list[list[dict[str, float]]]:
    """The histories of independent runs, one single-threaded run per core at a time (spawned processes, so
    each is the same float work as a run in this process); in this process when only one core is usable.
    The tiny model runs faster on one thread than with an OpenMP team on shared cores."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    import torch
    from sisrl.trainer.loop import train

    workers = min(len(configs), len(os.sched_getaffinity(0)))
    if workers <= 1:
        torch.set_num_threads(1)
        return [train(cfg) for cfg in configs]
    # Workers import only sisrl (tests/ is not importable by name under --import-mode=importlib).
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=torch.set_num_threads, initargs=(1,)) as pool:
        return list(pool.map(train, configs))
