"""Resumable checkpoints in safetensors + JSON (never pickle), written to a temp directory and renamed.

Layout of `RUN_DIR/checkpoints/step_000004/`:
  model.safetensors        parameters and buffers (FSDP2: model.rank{r}.safetensors, the local shards)
  optimizer.safetensors    every tensor of the optimizer state, keyed "state.{param}.{name}" (per rank under FSDP2)
  optimizer.json           param_groups and non-tensor state
  scheduler.json           the LR scheduler's state_dict (plain numbers)
  rng.rank{r}.safetensors  torch CPU / CUDA RNG states and the update generator, per rank
  rng.rank{r}.json         Python `random` state
  trainer_state.json       step, policy version, sampler cursor, world size, the config, and the rollout batches
                           in flight at the gateway (their request bodies; trainer/pipeline.py)
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from sisrl.common.atomic import replace_dir, write_json
from torch import Tensor, nn

STATE_FILE = "trainer_state.json"


@dataclass(frozen=True)
class TrainerState:
    step: int  # rollout batches completed
    policy_version: int
    sampler: dict[str, Any]
    world_size: int
    sharded: bool
    inflight: list[dict[str, Any]] = field(default_factory=list)  # batches submitted and not yet trained


def _local(t: Tensor) -> Tensor:
    local = t.to_local() if hasattr(t, "to_local") else t  # FSDP2 DTensor -> this rank's shard
    return local.detach().to("cpu").contiguous()


def _is_sharded(model: nn.Module) -> bool:
    return any(hasattr(p, "to_local") for p in model.parameters())


def _unique_state(model: nn.Module) -> dict[str, Tensor]:
    """state_dict with tied tensors kept once (safetensors refuses shared memory), as local CPU tensors."""
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for name, value in model.state_dict().items():
        local = value.to_local() if hasattr(value, "to_local") else value
        if local.data_ptr() in seen and local.numel() > 0:
            continue
        seen.add(local.data_ptr())
        out[name] = _local(local)
    return out


def _optimizer_split(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
    sd = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    plain: dict[str, dict[str, Any]] = {}
    for pid, entries in sd["state"].items():
        for name, value in entries.items():
            if isinstance(value, Tensor):
                tensors[f"state.{pid}.{name}"] = _local(value)
            else:
                plain.setdefault(str(pid), {})[name] = value
    return tensors, {"param_groups": sd["param_groups"], "plain_state": plain}


def _optimizer_join(tensors: dict[str, Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, pid, name = key.split(".", 2)
        state.setdefault(int(pid), {})[name] = value
    for pid, entries in meta["plain_state"].items():
        state.setdefault(int(pid), {}).update(entries)
    return {"state": state, "param_groups": meta["param_groups"]}


def _rng_tensors(generator: torch.Generator) -> dict[str, Tensor]:
    out = {"torch_cpu": torch.get_rng_state(), "update_generator": generator.get_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"torch_cuda_{i}"] = s
    return out


def save_checkpoint(run_dir: Path, *, step: int, policy_version: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                    generator: torch.Generator, sampler: dict[str, Any], config: dict[str, Any],
                    rank: int = 0, world: int = 1, keep: int = 2, barrier: Any = None,
                    inflight: list[dict[str, Any]] | None = None) -> Path:
    """Write checkpoint `step` (every rank calls this; only rank 0 writes shared files and renames)."""
    root = run_dir / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f".step_{step:06d}.tmp"
    sharded = _is_sharded(model)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if barrier is not None:
        barrier()
    if rank == 0 or sharded:
        suffix = f".rank{rank}" if sharded else ""
        inner = getattr(model, "module", model)
        save_file(_unique_state(inner), str(tmp / f"model{suffix}.safetensors"))
        opt_tensors, opt_meta = _optimizer_split(optimizer)
        save_file(opt_tensors, str(tmp / f"optimizer{suffix}.safetensors"))
        write_json(tmp / f"optimizer{suffix}.json", opt_meta)
    save_file(_rng_tensors(generator), str(tmp / f"rng.rank{rank}.safetensors"))
    state = random.getstate()
    write_json(tmp / f"rng.rank{rank}.json", {"python": [state[0], list(state[1]), state[2]]})
    if barrier is not None:
        barrier()
    if rank == 0:
        write_json(tmp / "scheduler.json", scheduler.state_dict())
        write_json(tmp / STATE_FILE, {"step": step, "policy_version": policy_version, "sampler": sampler,
                                       "world_size": world, "sharded": sharded, "config": config,
                                       "inflight": inflight or []})
        replace_dir(tmp, final)
        for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    if barrier is not None:
        barrier()
    return final


def _as_param_like(value: Tensor, param: Tensor, device: torch.device) -> Tensor:
    """Put a saved optimizer tensor back where its parameter lives (AdamW keeps `step` on the CPU); re-wrap
    an FSDP2 shard as a DTensor with the parameter's mesh and placements."""
    if value.dim() == 0:
        return value
    value = value.to(device)
    mesh = getattr(param, "device_mesh", None)
    if mesh is not None:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(value, mesh, param.placements)  # type: ignore[attr-defined]
    return value


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / STATE_FILE).is_file())
    return done[-1] if done else None


def load_checkpoint(path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, generator: torch.Generator,
                    rank: int = 0, world: int = 1) -> TrainerState:
    """Restore everything `save_checkpoint` wrote, in place; returns the trainer state."""
    meta = json.loads((path / STATE_FILE).read_text())
    sharded = bool(meta["sharded"])
    if sharded and meta["world_size"] != world:
        raise ValueError(f"{path} holds FSDP2 shards for {meta['world_size']} ranks; this run has {world}")
    suffix = f".rank{rank}" if sharded else ""
    inner = getattr(model, "module", model)
    weights = load_file(str(path / f"model{suffix}.safetensors"))
    with torch.no_grad():
        for name, value in inner.state_dict().items():
            if name not in weights:
                continue  # a tied tensor (lm_head = embeddings): restored through the name that was saved
            target = value.to_local() if hasattr(value, "to_local") else value
            target.copy_(weights[name])
    opt_meta = json.loads((path / f"optimizer{suffix}.json").read_text())
    device = next(inner.parameters()).device
    params = [p for group in optimizer.param_groups for p in group["params"]]
    opt_tensors = {k: _as_param_like(v, params[int(k.split(".")[1])], device) for k, v in
                   load_file(str(path / f"optimizer{suffix}.safetensors")).items()}
    optimizer.load_state_dict(_optimizer_join(opt_tensors, opt_meta))
    scheduler.load_state_dict(json.loads((path / "scheduler.json").read_text()))
    rng = load_file(str(path / f"rng.rank{rank}.safetensors"))
    torch.set_rng_state(rng["torch_cpu"])
    generator.set_state(rng["update_generator"])
    cuda = [rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    py = json.loads((path / f"rng.rank{rank}.json").read_text())["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    return TrainerState(step=int(meta["step"]), policy_version=int(meta["policy_version"]),
                        sampler=meta["sampler"], world_size=int(meta["world_size"]), sharded=sharded,
                        inflight=list(meta.get("inflight") or []))
