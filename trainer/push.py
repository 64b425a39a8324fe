"""A weight push: the policy written once, in the dtype the engine serves, as sharded safetensors in Hugging Face's
layout (`common/shards.py`), without a full copy of the weights on any rank.

Under FSDP2 each parameter is a DTensor sharded over the ranks. Every rank takes part in each parameter's
`full_tensor()` all-gather (a collective), one parameter at a time, in the same order; only rank 0 keeps the
gathered tensor: it converts it to the push dtype, moves it to the CPU, adds it to the current shard and drops
the gathered one; a shard is written as soon as its last tensor arrives. The other ranks drop their gathered
copy at once. So rank 0 holds at most one shard (`model.push_shard_mb`) plus the one tensor being gathered, and
the other ranks one gathered tensor. In one process (or under DDP) the same writer runs with no collective,
straight from the model's own tensors (a copy only where the push dtype differs).

Tied weights as `save_pretrained` writes them: a tensor that is the same parameter as an earlier one
(`lm_head.weight` under `tie_word_embeddings`) is written once, under its first name.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from sisrl.common.atomic import atomic_dir
from sisrl.common.shards import MIB, ShardWriter, plan_shards
from sisrl.trainer.policy import unwrap
from torch import Tensor, nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class PushStats:
    """What one rank held during a push (bytes of tensor data), sampled after every gather, conversion and write.

    `peak_live_bytes`: most bytes of gathered or converted tensors alive at once (rank 0: the shard being filled
    plus the tensor in hand; other ranks: the one gathered tensor). `peak_kept_bytes`: most bytes still alive at
    the end of a parameter's turn, once its gathered copy was dropped (0 on ranks other than 0)."""

    tensors: int = 0
    shards: int = 0
    bytes_written: int = 0
    largest_gathered_bytes: int = 0
    peak_live_bytes: int = 0
    peak_kept_bytes: int = 0
    _live: list[tuple[weakref.ref[Tensor], int]] = field(default_factory=list, repr=False)

    def track(self, tensor: Tensor) -> None:
        """Count `tensor` as held until it is garbage (a weak reference: holding it here would keep it alive)."""
        if all(ref() is not tensor for ref, _ in self._live):
            self._live.append((weakref.ref(tensor), tensor.nbytes))

    def live_bytes(self) -> int:
        self._live = [(ref, n) for ref, n in self._live if ref() is not None]
        return sum(n for _, n in self._live)

    def figures(self) -> dict[str, int]:
        """The counters as plain numbers (for a log line, a bench record, a test across processes)."""
        return {"tensors": self.tensors, "shards": self.shards, "bytes_written": self.bytes_written,
                "largest_gathered_bytes": self.largest_gathered_bytes, "peak_live_bytes": self.peak_live_bytes,
                "peak_kept_bytes": self.peak_kept_bytes}

    def sample(self, *, end_of_param: bool = False) -> None:
        live = self.live_bytes()
        self.peak_live_bytes = max(self.peak_live_bytes, live)
        if end_of_param:
            self.peak_kept_bytes = max(self.peak_kept_bytes, live)


def unique_tensors(model: nn.Module) -> list[tuple[str, Tensor]]:
    """(name, tensor) of the model's state dict (parameters and persistent buffers, DTensors under FSDP2), each
    tensor once: a name bound to the same parameter as an earlier name (tied embeddings) is left out."""
    seen: set[int] = set()
    out = []
    for name, value in unwrap(model).state_dict(keep_vars=True).items():
        if id(value) not in seen:
            seen.add(id(value))
            out.append((name, value))
    return out


def _gather(value: Tensor, stats: PushStats) -> Tensor:
    """`value` in full: a DTensor's `full_tensor()` is an all-gather every rank must run; a plain tensor as is."""
    full = (value.full_tensor() if hasattr(value, "full_tensor") else value).detach()
    stats.track(full)
    stats.largest_gathered_bytes = max(stats.largest_gathered_bytes, full.nbytes)
    stats.sample()
    return full


@torch.no_grad()
def write_push(model: nn.Module, tokenizer: PreTrainedTokenizerBase, out: Path, *, dtype: torch.dtype,
               max_shard_bytes: int, is_main: bool = True) -> PushStats:
    """Write the policy to the HF directory `out` (rank 0; call on every rank under FSDP2: collectives) as sharded
    safetensors in `dtype`, with its config (`dtype` recorded), generation config and tokenizer; durably, as
    `common/atomic.atomic_dir` writes (temp directory beside `out`, every file fsynced, then renamed).
    Returns this rank's `PushStats`."""
    base = unwrap(model)
    if not isinstance(base, PreTrainedModel):
        raise TypeError(f"expected a transformers PreTrainedModel, got {type(base).__name__}")
    tensors = unique_tensors(base)
    stats = PushStats()
    if not is_main:
        for _, value in tensors:
            _gather(value, stats)  # the gathered copy is dropped as the call returns
            stats.sample(end_of_param=True)
        return stats
    itemsize = torch.empty((), dtype=dtype).element_size()
    plan = plan_shards([(name, value.numel() * itemsize) for name, value in tensors], max_shard_bytes)
    done = 0
    try:
        with atomic_dir(out, overwrite=True) as tmp:
            writer = ShardWriter(tmp, plan)
            for name, value in tensors:
                # converted where it was gathered (on a GPU: half the bytes over PCIe for fp32 -> bf16), then moved;
                # the gathered tensor is released as soon as its copy exists (it is that copy when nothing changes)
                kept = _gather(value, stats).to(dtype=dtype).to("cpu").contiguous()
                done += 1
                stats.track(kept)
                stats.sample()
                writer.add(name, kept)
                del kept
                stats.sample(end_of_param=True)
            writer.finish()
            _write_side_files(base, tokenizer, tmp, dtype)
    finally:
        with contextlib.suppress(Exception):
            for _, value in tensors[done:]:  # after a failed write rank 0 still joins the remaining gathers, so
                _gather(value, stats)  # that the other ranks do not hang in them
    stats.tensors, stats.shards, stats.bytes_written = len(tensors), len(plan), writer.total_size
    return stats


def _write_side_files(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path,
                      dtype: torch.dtype) -> None:
    """config.json (its `dtype` the push's, as save_pretrained records the saved dtype), generation_config.json
    and the tokenizer."""
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.dtype = dtype
    config.save_pretrained(folder)
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def resolve_push_dtype(setting: str, *, served: str | None, trained: str) -> torch.dtype:
    """`model.push_dtype`: an explicit dtype as is; `auto` = the dtype the gateway's engine serves in (`served`,
    its /health `weights_dtype`, None when it does not say), else the trainer's own (`model.dtype`)."""
    name = setting if setting != "auto" else served or trained
    if name not in DTYPES:
        what = "the gateway's weights_dtype" if setting == "auto" and served else "model.push_dtype"
        raise ValueError(f"{what}: {name!r} is not a push dtype, expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def push_shard_bytes(mb: int) -> int:
    """`model.push_shard_mb` in bytes."""
    return mb * MIB
