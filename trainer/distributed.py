"""torch.distributed plumbing for torchrun: process group, DDP / FSDP2 wrapping, broadcast of the batch.

Rank 0 alone talks to the gateway; it broadcasts the trajectories as Arrow IPC bytes (trainer/arrow_batch.py;
never pickle) and every rank builds the same padded batch, then trains on its rows of each mini-batch (trainer/update.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from sisrl.trainer.config import DistributedConfig
from torch import nn


@dataclass(frozen=True)
class DistContext:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(pref: str, local_rank: int) -> torch.device:
    if pref == "auto":
        pref = "cuda" if torch.cuda.is_available() else "cpu"
    if pref == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device: 'cuda' was requested but torch sees no CUDA device")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(pref)


def init_distributed(cfg: DistributedConfig, device_pref: str) -> DistContext:
    """Join the torchrun process group when WORLD_SIZE > 1 (env:// rendezvous); a single process otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_pref, local_rank)
    if world > 1 and not dist.is_initialized():
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        dist.init_process_group(backend=backend)
    if world > 1 and cfg.strategy == "none":
        raise ValueError(f"WORLD_SIZE={world} but distributed.strategy is 'none'; choose 'ddp' or 'fsdp2'")
    return DistContext(rank=rank, world=world, local_rank=local_rank, device=device)


def wrap_model(model: nn.Module, ctx: DistContext, strategy: str) -> nn.Module:
    """DDP, or FSDP2 `fully_shard` on every decoder layer and then the root; unchanged for one process.

    The root unit holds what is left: the embeddings, the final norm and the lm_head (one weight when they are
    tied, so they must share a unit). Its parameters are gathered by the root module's forward hook, which is why
    `policy.policy_logits` always calls the whole model and never the decoder or the head alone."""
    if not ctx.enabled or strategy == "none":
        return model
    if strategy == "ddp":
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    _fully_shard(model, reshard_root=False)
    return model


def wrap_reference(model: nn.Module, ctx: DistContext, strategy: str) -> nn.Module:
    """The frozen KL reference (eval mode, no grads), laid out like the policy: sharded by FSDP2 the same way, so a
    rank holds 1/world of it rather than a full fp32 copy; unchanged otherwise (DDP keeps a full policy per rank
    anyway, and DDP needs parameters that train).

    Sharding, rather than computing its log-probs once per batch before the mini-batch loop (verl's way): each row
    lands in exactly one mini-batch, so the per-micro-batch forward already runs the reference once per row, and
    a one-pass precompute would save no compute while still needing the whole reference on every rank."""
    model.eval().requires_grad_(False)
    if ctx.enabled and strategy == "fsdp2":
        # The root unit reshards after forward too: with no backward to come, the default (keep the root's
        # parameters gathered until the backward) would keep the whole embedding and lm_head on every rank.
        _fully_shard(model, reshard_root=True)
    return model


def _fully_shard(model: nn.Module, *, reshard_root: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    for layer in layers if isinstance(layers, nn.ModuleList) else []:
        fully_shard(layer)
    if reshard_root:
        fully_shard(model, reshard_after_forward=True)
    else:
        fully_shard(model)


def broadcast_bytes(data: bytes | None, ctx: DistContext) -> bytes:
    """Rank 0's bytes on every rank: length first, then a uint8 tensor."""
    if not ctx.enabled:
        if data is None:
            raise ValueError("broadcast_bytes: rank 0 must pass data")
        return data
    dev = ctx.device if dist.get_backend() == "nccl" else torch.device("cpu")
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.long, device=dev)
    dist.broadcast(size, src=0)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if ctx.is_main and data is not None
           else torch.empty(int(size.item()), dtype=torch.uint8, device=dev))
    dist.broadcast(buf, src=0)
    return bytes(buf.cpu().numpy().tobytes())


def mean_over_ranks(metrics: dict[str, float], ctx: DistContext) -> dict[str, float]:
    """Average every metric over ranks (the same keys on every rank); min/max keys take min/max."""
    if not ctx.enabled or not metrics:
        return metrics
    keys = sorted(metrics)
    dev = ctx.device if dist.get_backend() == "nccl" else torch.device("cpu")
    vals = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=dev)
    lo, hi, total = vals.clone(), vals.clone(), vals.clone()
    dist.all_reduce(total)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    out = {}
    for i, key in enumerate(keys):
        if key.endswith("_min"):
            out[key] = float(lo[i])
        elif key.endswith("_max"):
            out[key] = float(hi[i])
        elif key.startswith("guard/") or key == "actor/updates":
            out[key] = float(hi[i])  # counts agree on every rank (gradients are all-reduced)
        else:
            out[key] = float(total[i]) / ctx.world
    return out


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier()


def shutdown(ctx: DistContext) -> None:
    """Leave the process group together: a rank that tears gloo down while a peer still works (saving a
    checkpoint, say) can make that peer's gloo thread abort ("terminate called without an active exception")."""
    if ctx.enabled and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
