"""One policy update on a fixed batch, single-process or as one torchrun rank (used by test_distributed.py).

    torchrun --nproc-per-node 2 tests/trainer/ddp_worker.py BATCH.json OUT_DIR
writes OUT_DIR/{ddp,fsdp2}_CASE.safetensors (FSDP2 shards gathered to full tensors)
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from sisrl.trainer.batch import Trajectory, collate
from sisrl.trainer.config import TrainConfig, config_from_dict
from sisrl.trainer.distributed import init_distributed, shutdown, wrap_model, wrap_reference
from sisrl.trainer.policy import build_scheduler, load_policy
from sisrl.trainer.update import Updater, train_on_batch

STRATEGIES = ("ddp", "fsdp2")
CASES: dict[str, dict[str, dict[str, object]]] = {
    # plain IS on q perturbed away from pi: ratios != 1, token-mean over global tokens, 2 micro-batches per rank
    "is_token_mean": {"algorithm": {"ratio": "is", "behaviour": "rollout", "agg_mode": "token-mean"},
                      "optim": {"micro_batch_size": 2}},
    # SIS with recomputed q (pi == q: every top-K token accepted, no randomness), seq-mean aggregation,
    # entropy bonus
    "sis_seq_mean": {"algorithm": {"ratio": "sis", "behaviour": "recompute", "agg_mode": "seq-mean-token-mean",
                                   "entropy_coef": 0.01}},
    # a KL penalty to a reference model with compact logits; under FSDP2 the reference is sharded like the policy
    # (the GPU recipe's KL 0.001 under FSDP2 once crashed on a layout mismatch between the two)
    "is_kl_ref": {"algorithm": {"ratio": "is", "behaviour": "rollout", "kl_coef": 0.1},
                  "model": {"compact_logits": True}},
}


def case_config(case: str, strategy: str) -> TrainConfig:
    tree = {"rollout": {"source": "synthetic", "prompts_per_step": 4, "samples_per_prompt": 2},
            "model": {"path": "tiny"}, "device": "cpu", "distributed": {"strategy": strategy},
            "algorithm": {"staleness": 1, "logprobs_k": 8, "loss": "grpo"}, "optim": {"grad_clip": None}}
    for section, values in CASES[case].items():
        tree[section] = {**tree.get(section, {}), **values}  # type: ignore[dict-item]
    return config_from_dict(tree)


def one_update(case: str, trajs: list[Trajectory], strategy: str) -> dict[str, torch.Tensor]:
    """SGD with lr 1 (the parameter change is exactly the gradient), one mini-batch, no clipping."""
    torch.set_num_threads(1)
    cfg = case_config(case, strategy)
    ctx = init_distributed(cfg.distributed, "cpu")
    model, tok = load_policy(cfg.model, seed=0, device=ctx.device)
    ref = copy.deepcopy(model) if cfg.algorithm.kl_coef > 0 else None
    model = wrap_model(model, ctx, cfg.distributed.strategy)
    ref = None if ref is None else wrap_reference(ref, ctx, cfg.distributed.strategy)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = build_scheduler(optimizer, cfg.optim, 1)
    u = Updater(model=model, optimizer=optimizer, scheduler=scheduler, algo=cfg.algorithm, optim=cfg.optim,
                temperature=1.0, rank=ctx.rank, world=ctx.world, ref_model=ref, compact_logits=cfg.model.compact_logits)
    b = collate(trajs, pad_id=int(tok.pad_token_id), k=cfg.algorithm.logprobs_k)
    train_on_batch(u, b, torch.Generator().manual_seed(0))
    inner = getattr(model, "module", model)
    # full_tensor() gathers FSDP2 shards (a collective, so every rank calls it)
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone().contiguous()
            for k, v in inner.named_parameters()}


if __name__ == "__main__":
    batch_path, out_dir = sys.argv[1:3]
    batch = [Trajectory.from_json(o) for o in json.loads(Path(batch_path).read_text())]
    for strategy in STRATEGIES:
        for name in CASES:
            params = one_update(name, batch, strategy)
            if int(os.environ.get("RANK", "0")) == 0:
                save_file(params, str(Path(out_dir) / f"{strategy}_{name}.safetensors"))
    shutdown(init_distributed(case_config(next(iter(CASES)), "ddp").distributed, "cpu"))
