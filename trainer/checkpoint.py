"""Resumable checkpoints in safetensors + JSON (never pickle): durable, and checked before a run resumes from one.

Layout of `RUN_DIR/checkpoints/step_000004/`:
  model.safetensors        parameters and buffers (FSDP2: model.rank{r}.safetensors, the local shards)
  optimizer.safetensors    every tensor of the optimizer state, keyed "state.{param}.{name}" (per rank under FSDP2)
  optimizer.json           param_groups and non-tensor state
  scheduler.json           the LR scheduler's state_dict (plain numbers)
  rng.rank{r}.safetensors  torch CPU / CUDA RNG states and the update generator, per rank
  rng.rank{r}.json         Python `random` state
  trainer_state.json       step, policy version, sampler cursor, world size, the config, and the rollout batches
                           in flight at the gateway (their request bodies; trainer/pipeline.py)
  COMPLETE                 written last: the step and the size in bytes of every other file

A save (common/atomic.py has the fsync rules): every rank writes its files into `.step_000004.tmp` and fsyncs
each; after a barrier rank 0 writes the shared files and COMPLETE, fsyncs the directory, renames it to
`step_000004` and fsyncs `checkpoints/` and the run directory. A kill at any point leaves the temp directory
(removed at the next start: `sweep_temps`) or the complete checkpoint, never a partial `step_*`.

Complete (`check_complete`) means: COMPLETE parses, names this step, and every file it lists exists with that
size. A checkpoint of a sisrl from before COMPLETE (no marker, and a trainer_state.json without "format") is
accepted with a log line: its writer, too, renamed the directory into place after writing trainer_state.json
last. A resumed run reads the newest checkpoint that is complete and readable (`read_latest`); a torn one is
skipped with one log line naming it and why, and left on disk as it is.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from sisrl.common.atomic import fsync_path, remove_dir, replace_dir
from torch import Tensor, nn

STATE_FILE = "trainer_state.json"
MARKER = "COMPLETE"
FORMAT = 2  # trainer_state.json "format": written by a sisrl that also writes COMPLETE (absent: an older one)
PAUSE_ENV = "SISRL_TEST_CHECKPOINT_PAUSE"  # fault injection for the kill test only (`_test_pause`)

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint directory that is torn (not complete) or unreadable; the message names it and why."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


@dataclass(frozen=True)
class TrainerState:
    step: int  # rollout batches completed
    policy_version: int
    sampler: dict[str, Any]
    world_size: int
    sharded: bool
    inflight: list[dict[str, Any]] = field(default_factory=list)  # batches submitted and not yet trained


@dataclass(frozen=True)
class Restorable:
    """One rank's part of a checkpoint, read into memory and checked (`read_checkpoint`), not yet applied."""

    path: Path
    legacy: bool  # written before COMPLETE markers, accepted on its trainer_state.json
    meta: dict[str, Any]  # trainer_state.json
    weights: dict[str, Tensor]
    opt_tensors: dict[str, Tensor]
    opt_meta: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Tensor]
    python_rng: list[Any]


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


def _save_tensors(directory: Path, name: str, tensors: dict[str, Tensor], label: str) -> None:
    save_file(tensors, str(directory / name))
    fsync_path(directory / name)
    _test_pause(f"{label}/{name}")


def _save_json(directory: Path, name: str, obj: Any, label: str) -> None:
    # Written in place: the whole directory is the temp copy, and its rename the commit.
    (directory / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    fsync_path(directory / name)
    _test_pause(f"{label}/{name}")


def _test_pause(point: str) -> None:
    """Fault injection for tests/trainer/test_checkpoint_kill.py, inert unless its variable is set:
    `SISRL_TEST_CHECKPOINT_PAUSE=step_000002/model.safetensors:SIGNAL_FILE` makes the save, once it has written
    that file, create SIGNAL_FILE and wait there until the test kills the process."""
    spec = os.environ.get(PAUSE_ENV)
    if not spec or spec.partition(":")[0] != point:
        return
    Path(spec.partition(":")[2]).touch()
    while True:
        time.sleep(1.0)


def _seal(directory: Path, step: int, label: str) -> None:
    """Write COMPLETE once every other file is durable, then fsync the directory: its names (the other ranks'
    files too) are durable before the rename makes the checkpoint visible."""
    files = {p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file()}
    _save_json(directory, MARKER, {"step": step, "format": FORMAT, "files": files}, label)
    fsync_path(directory)


def save_checkpoint(run_dir: Path, *, step: int, policy_version: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                    generator: torch.Generator, sampler: dict[str, Any], config: dict[str, Any],
                    rank: int = 0, world: int = 1, keep: int = 2, barrier: Any = None,
                    inflight: list[dict[str, Any]] | None = None) -> Path:
    """Write checkpoint `step` (every rank calls this; only rank 0 writes shared files and renames), then keep the
    `keep` newest complete checkpoints."""
    root = run_dir / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f".{final.name}.tmp"
    sharded = _is_sharded(model)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if barrier is not None:
        barrier()
    if rank == 0 or sharded:
        suffix = f".rank{rank}" if sharded else ""
        inner = getattr(model, "module", model)
        _save_tensors(tmp, f"model{suffix}.safetensors", _unique_state(inner), final.name)
        opt_tensors, opt_meta = _optimizer_split(optimizer)
        _save_tensors(tmp, f"optimizer{suffix}.safetensors", opt_tensors, final.name)
        _save_json(tmp, f"optimizer{suffix}.json", opt_meta, final.name)
    _save_tensors(tmp, f"rng.rank{rank}.safetensors", _rng_tensors(generator), final.name)
    state = random.getstate()
    _save_json(tmp, f"rng.rank{rank}.json", {"python": [state[0], list(state[1]), state[2]]}, final.name)
    if barrier is not None:
        barrier()
    if rank == 0:
        _save_json(tmp, "scheduler.json", scheduler.state_dict(), final.name)
        _save_json(tmp, STATE_FILE, {"step": step, "policy_version": policy_version, "sampler": sampler,
                                     "world_size": world, "sharded": sharded, "config": config,
                                     "inflight": inflight or [], "format": FORMAT}, final.name)
        _seal(tmp, step, final.name)
        replace_dir(tmp, final)  # renamed, and `checkpoints/` fsynced
        fsync_path(run_dir)  # `checkpoints/` itself may be new
        _prune(root, keep)
    if barrier is not None:
        barrier()
    return final


def _prune(root: Path, keep: int) -> None:
    """Keep the `keep` newest complete checkpoints and remove every older one. A torn checkpoint newer than those
    stays (for a person to look at) until a save of its step replaces it."""
    kept = 0
    for path in checkpoint_dirs(root.parent):
        if kept >= keep:
            remove_dir(path)  # renamed aside first: never seen half-deleted
            continue
        try:
            check_complete(path)
            kept += 1
        except CheckpointError:
            pass


def _as_param_like(value: Tensor, param: Tensor, device: torch.device) -> Tensor:
    """Put a saved optimizer tensor back where its parameter lives (AdamW keeps `step` on the CPU); re-wrap
    an FSDP2 shard as a DTensor with the parameter's mesh and placements."""
    if value.dim() == 0:
        return value
    value = value.to(device)
    mesh = getattr(param, "device_mesh", None)
    if mesh is not None:
        from torch.distributed.tensor import DTensor

        # the global shape and stride given: FSDP2 shards an uneven dimension unevenly (a 151,669-row embedding on
        # 2 ranks: 75,835 + 75,834), and from_local would otherwise assume every rank holds this rank's rows
        return DTensor.from_local(value, mesh, param.placements, shape=param.shape,  # type: ignore[attr-defined]
                                  stride=param.stride())
    return value


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Every `RUN_DIR/checkpoints/step_*` directory, newest first, complete or not."""
    return sorted((p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir()), reverse=True)


def check_complete(path: Path) -> bool:
    """Raise CheckpointError saying why `path` is not a complete checkpoint (module docstring). Returns True
    when COMPLETE vouches for it, False for a checkpoint from before COMPLETE markers."""
    marker = path / MARKER
    if not marker.is_file():
        return _check_legacy(path)
    try:
        meta = json.loads(marker.read_text())
        step, files = int(meta["step"]), {str(k): int(v) for k, v in meta["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(path, f"{MARKER} is unreadable ({err!r})") from err
    if path.name != f"step_{step:06d}":
        raise CheckpointError(path, f"{MARKER} is for step {step}")
    for name, size in sorted(files.items()):
        try:
            actual = (path / name).stat().st_size
        except FileNotFoundError as err:
            raise CheckpointError(path, f"{name} is missing") from err
        if actual != size:
            raise CheckpointError(path, f"{name} is {actual} bytes, {MARKER} says {size}")
    return True


def _check_legacy(path: Path) -> bool:
    try:
        meta = json.loads((path / STATE_FILE).read_text())
    except FileNotFoundError as err:
        raise CheckpointError(path, f"no {MARKER} and no {STATE_FILE}: its save did not finish") from err
    except (OSError, ValueError) as err:
        raise CheckpointError(path, f"no {MARKER}, and {STATE_FILE} is unreadable ({err!r})") from err
    if not isinstance(meta, dict) or "format" in meta:
        raise CheckpointError(path, f"no {MARKER}: its save did not finish")
    return False


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (`check_complete`, files not opened), logging each newer torn one and why."""
    for path in checkpoint_dirs(run_dir):
        try:
            check_complete(path)
            return path
        except CheckpointError as err:
            log.warning("checkpoint %s is torn (%s); skipping it", path, err.why)
    return None


def read_checkpoint(path: Path, *, rank: int = 0, world: int = 1) -> Restorable:
    """Check `path` (`check_complete`) and read this rank's files; CheckpointError when torn or unreadable,
    ValueError when its FSDP2 shards are for another world size (not a torn checkpoint: the wrong run)."""
    legacy = not check_complete(path)
    try:
        meta = json.loads((path / STATE_FILE).read_text())
        sharded = bool(meta["sharded"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(path, f"{STATE_FILE} is unreadable ({err!r})") from err
    if sharded and meta["world_size"] != world:
        raise ValueError(f"{path} holds FSDP2 shards for {meta['world_size']} ranks; this run has {world}")
    suffix = f".rank{rank}" if sharded else ""
    try:
        return Restorable(
            path=path, legacy=legacy, meta=meta,
            weights=load_file(str(path / f"model{suffix}.safetensors")),
            opt_tensors=load_file(str(path / f"optimizer{suffix}.safetensors")),
            opt_meta=json.loads((path / f"optimizer{suffix}.json").read_text()),
            scheduler=json.loads((path / "scheduler.json").read_text()),
            rng=load_file(str(path / f"rng.rank{rank}.safetensors")),
            python_rng=json.loads((path / f"rng.rank{rank}.json").read_text())["python"])
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as err:
        raise CheckpointError(path, f"unreadable ({err!r})") from err


def read_latest(run_dir: Path, *, rank: int = 0, world: int = 1,
                agree: Callable[[bool], bool] | None = None) -> Restorable | None:
    """The newest checkpoint that is complete and readable, or None when `run_dir` has none. A torn one is
    skipped with one log line naming it and why; the run falls back to the one before it.

    `agree(ok)` returns True when `ok` is True on every rank, so that all ranks fall back together. Raises
    CheckpointError when checkpoints exist and none can be read: starting over would drop them unannounced.
    """
    torn: list[str] = []
    for path in checkpoint_dirs(run_dir):
        found: Restorable | None = None
        why = "unreadable on another rank"
        try:
            found = read_checkpoint(path, rank=rank, world=world)
        except CheckpointError as err:
            why = err.why
        if agree(found is not None) if agree is not None else found is not None:
            assert found is not None, "agree() said every rank read the checkpoint"
            if found.legacy:
                log.info("checkpoint %s has no %s (written by an older sisrl): accepted on its %s", path, MARKER,
                         STATE_FILE)
            return found
        log.warning("checkpoint %s is torn (%s); falling back to the one before it", path, why)
        torn.append(f"{path.name}: {why}")
    if torn:
        raise CheckpointError(run_dir / "checkpoints", f"no complete checkpoint ({'; '.join(torn)}); move them "
                              "away to start over")
    return None


def restore(ckpt: Restorable, *, model: nn.Module, optimizer: torch.optim.Optimizer,
            scheduler: torch.optim.lr_scheduler.LRScheduler, generator: torch.Generator) -> TrainerState:
    """Put everything `save_checkpoint` wrote back in place; returns the trainer state."""
    inner = getattr(model, "module", model)
    with torch.no_grad():
        for name, value in inner.state_dict().items():
            if name not in ckpt.weights:
                continue  # a tied tensor (lm_head = embeddings): restored through the name that was saved
            target = value.to_local() if hasattr(value, "to_local") else value
            target.copy_(ckpt.weights[name])
    device = next(inner.parameters()).device
    params = [p for group in optimizer.param_groups for p in group["params"]]
    opt_tensors = {k: _as_param_like(v, params[int(k.split(".")[1])], device) for k, v in ckpt.opt_tensors.items()}
    optimizer.load_state_dict(_optimizer_join(opt_tensors, ckpt.opt_meta))
    scheduler.load_state_dict(ckpt.scheduler)
    torch.set_rng_state(ckpt.rng["torch_cpu"])
    generator.set_state(ckpt.rng["update_generator"])
    cuda = [ckpt.rng[k] for k in sorted(ckpt.rng) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    py = ckpt.python_rng
    random.setstate((py[0], tuple(py[1]), py[2]))
    meta = ckpt.meta
    return TrainerState(step=int(meta["step"]), policy_version=int(meta["policy_version"]),
                        sampler=meta["sampler"], world_size=int(meta["world_size"]), sharded=bool(meta["sharded"]),
                        inflight=list(meta.get("inflight") or []))


def load_checkpoint(path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, generator: torch.Generator,
                    rank: int = 0, world: int = 1) -> TrainerState:
    """`read_checkpoint` then `restore`: load one given checkpoint, no fallback."""
    return restore(read_checkpoint(path, rank=rank, world=world), model=model, optimizer=optimizer,
                   scheduler=scheduler, generator=generator)
