"""Sharded safetensors directories in Hugging Face's layout: plan, write shard by shard, read back shard by shard.

The layout is the one `transformers`' `save_pretrained` writes and `from_pretrained` / vLLM read
(huggingface_hub's `split_torch_state_dict_into_shards` docs and transformers' "Sharded checkpoints" guide):
files `model-00001-of-0000N.safetensors` ... and `model.safetensors.index.json`,
`{"metadata": {"total_size": <bytes of tensor data>}, "weight_map": {<tensor name>: <file name>}}`.
We always write the index, even for one shard, so readers see one layout.

The shard plan is made from names and sizes alone (shapes and the target dtype), before any tensor exists, so a
writer knows N up front and can write each shard as soon as its last tensor arrives (`ShardWriter`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from sisrl.common.atomic import write_json

INDEX_NAME = "model.safetensors.index.json"
MIB = 1 << 20


def shard_name(i: int, n: int) -> str:
    """File name of shard `i` (1-based) of `n`, as transformers names them."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Group (name, bytes) in order into shards of at most `max_shard_bytes`; a tensor larger than that gets a
    shard of its own (as in transformers). Returns the names of each shard."""
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    shards: list[list[str]] = []
    room = 0
    for name, nbytes in sizes:
        if not shards or nbytes > room:
            shards.append([])
            room = max_shard_bytes
        shards[-1].append(name)
        room -= nbytes
    return shards


@dataclass
class ShardWriter:
    """Write a planned sharded directory one shard at a time: `add` tensors in plan order; a shard is written
    (and its tensors released) when its last tensor arrives; `finish` writes the index.

    `held_bytes` counts the tensor bytes this writer holds that are not yet on disk; `peak_held_bytes` is its
    maximum, at most the largest planned shard (`max_shard_bytes`, or one tensor larger than that)."""

    folder: Path
    plan: list[list[str]]
    held_bytes: int = 0
    peak_held_bytes: int = 0
    total_size: int = 0
    _pending: dict[str, torch.Tensor] = field(default_factory=dict)
    _shard: int = 0
    _next: int = 0  # index, inside the current shard, of the name `add` expects next

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Take `tensor` (contiguous, CPU) as `name`; ValueError when it is not the name the plan expects next."""
        if self._shard >= len(self.plan) or self.plan[self._shard][self._next] != name:
            expected = self.plan[self._shard][self._next] if self._shard < len(self.plan) else "nothing (plan done)"
            raise ValueError(f"tensor {name!r} out of plan order: expected {expected!r}")
        self._pending[name] = tensor
        self.held_bytes += tensor.nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        self._next += 1
        if self._next == len(self.plan[self._shard]):
            self._write_shard()

    def _write_shard(self) -> None:
        # safetensors >= 0.6 writes straight from each tensor's memory (no bytes copy of the shard).
        save_file(self._pending, str(self.folder / shard_name(self._shard + 1, len(self.plan))),
                  metadata={"format": "pt"})
        self.total_size += self.held_bytes
        self._pending, self.held_bytes = {}, 0
        self._shard, self._next = self._shard + 1, 0

    def finish(self) -> Path:
        """Write `model.safetensors.index.json` once every planned tensor is on disk; returns its path."""
        if self._shard != len(self.plan):
            raise ValueError(f"{sum(len(s) for s in self.plan[self._shard:]) - self._next} planned tensors "
                             f"never arrived, first {self.plan[self._shard][self._next]!r}")
        n = len(self.plan)
        weight_map = {name: shard_name(i + 1, n) for i, names in enumerate(self.plan) for name in names}
        index = self.folder / INDEX_NAME
        write_json(index, {"metadata": {"total_size": self.total_size}, "weight_map": weight_map})
        return index


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of `path`: the file itself, the shards a directory's index names (each must exist),
    or, without an index, every `*.safetensors` of the directory. FileNotFoundError when there are none."""
    root = Path(path)
    if root.is_file() and root.suffix == ".safetensors":
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"weights path {str(path)!r} is neither a .safetensors file nor a directory")
    index = root / INDEX_NAME
    if index.is_file():
        files = [root / name for name in sorted(set(read_index(index).values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names {len(missing)} missing shard(s), e.g. {missing[0]!r}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {str(path)!r}")
    return files


def read_index(index: Path) -> dict[str, str]:
    """The weight map (tensor name -> shard file name) of a `model.safetensors.index.json`."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{index} is not a safetensors index with a weight_map: {exc!r}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: weight_map must map tensor names to file names")
    return weight_map


def iter_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of `path`, read one at a time, shard after shard: a reader holds one tensor,
    never the whole checkpoint. ValueError names a file that is not readable safetensors."""
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except SafetensorError as exc:
            raise ValueError(f"{file} is not a readable safetensors file: {exc}") from exc
