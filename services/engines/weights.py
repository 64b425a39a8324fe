"""Check a safetensors checkpoint (HF directory, sharded or not, or one file) against a model from its headers
alone, then copy it in one tensor at a time.

A push is a directory of shards (`common/shards.py`); an engine never holds a second full copy of the weights:
the names and shapes come from the headers (no tensor data read), and `copy_safetensors` reads each tensor,
copies it into the model and drops it before the next one.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from sisrl.common.shards import INDEX_NAME, iter_safetensors, read_index, safetensors_files

__all__ = ["check_like", "check_shapes", "copy_safetensors", "iter_safetensors", "safetensors_files",
           "safetensors_shapes"]


def safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of `path`, from the safetensors headers only (no tensor data). Opening a
    file checks that its size matches its header, so a truncated shard is refused here. A directory's index
    must name exactly the tensors its shards hold."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as handle:
                shapes.update({name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()})
        except SafetensorError as exc:
            raise ValueError(f"{file} is not a readable safetensors file: {exc}") from exc
    index = Path(path) / INDEX_NAME
    if index.is_file() and set(read_index(index)) != set(shapes):
        extra = sorted(set(read_index(index)) ^ set(shapes))
        raise ValueError(f"{index} and its shards name different tensors, e.g. {extra[:3]}")
    return shapes


def check_like(shapes: dict[str, tuple[int, ...]], reference: dict[str, tuple[int, ...]], *,
               optional: set[str]) -> None:
    """Raise ValueError unless `shapes` has the names and shapes of `reference` (names in `optional`, e.g. a tied
    `lm_head.weight`, may be present in one and absent in the other)."""
    unexpected = sorted(set(shapes) - set(reference) - optional)
    missing = sorted(set(reference) - set(shapes) - optional)
    if unexpected or missing:
        raise ValueError(f"checkpoint names differ from the served model's: {len(unexpected)} unexpected "
                         f"(e.g. {unexpected[:3]}), {len(missing)} missing (e.g. {missing[:3]})")
    for name, shape in shapes.items():
        if name in reference and shape != reference[name]:
            raise ValueError(f"{name}: checkpoint shape {shape} != served model {reference[name]}")


def check_shapes(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise ValueError unless `shapes` (a checkpoint's names and shapes) gives every parameter of `model` with
    the right shape.

    A name may be missing when it is tied to a present one (save_pretrained drops tied `lm_head.weight`).
    """
    own = model.state_dict()
    unexpected = sorted(set(shapes) - set(own))
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} names the model lacks, e.g. {unexpected[:3]}")
    for name, shape in shapes.items():
        if shape != tuple(own[name].shape):
            raise ValueError(f"{name}: checkpoint shape {shape} != model {tuple(own[name].shape)}")
    aliases: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), set()).add(name)
    for names in aliases.values():
        if not names & set(shapes):
            raise ValueError(f"checkpoint lacks parameter {sorted(names)[0]!r}")


@torch.no_grad()
def copy_safetensors(model: torch.nn.Module, path: str | Path) -> int:
    """Copy every tensor of `path` into `model`'s tensors in place (cast to the model's dtype), one tensor read
    at a time; call `check_shapes` first. Returns how many tensors were copied."""
    own = model.state_dict()
    count = 0
    for name, tensor in iter_safetensors(path):
        own[name].copy_(tensor)
        count += 1
    return count
