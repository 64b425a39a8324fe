"""Read a safetensors checkpoint (HF directory or single file) and check it fits a model before any swap."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file


def safetensors_files(path: str) -> list[Path]:
    """The `.safetensors` files of `path` (one file, or every one in a directory); FileNotFoundError if none."""
    root = Path(path)
    if root.is_file() and root.suffix == ".safetensors":
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"weights path {path!r} is neither a .safetensors file nor a directory")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path!r}")
    return files


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """All tensors of `path`: a `.safetensors` file or a directory of them (sharded HF checkpoints)."""
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        try:
            state.update(load_file(str(file)))
        except SafetensorError as exc:
            raise ValueError(f"{file} is not a readable safetensors file: {exc}") from exc
    return state


def safetensors_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of `path`, read from the safetensors headers only (no tensor data)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as handle:
                shapes.update({name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()})
        except SafetensorError as exc:
            raise ValueError(f"{file} is not a readable safetensors file: {exc}") from exc
    return shapes


def check_like(state: dict[str, torch.Tensor], reference: dict[str, tuple[int, ...]], *, optional: set[str]) -> None:
    """Raise ValueError unless `state` has the names and shapes of `reference` (names in `optional`, e.g. a tied
    `lm_head.weight`, may be present in one and absent in the other)."""
    unexpected = sorted(set(state) - set(reference) - optional)
    missing = sorted(set(reference) - set(state) - optional)
    if unexpected or missing:
        raise ValueError(f"checkpoint names differ from the served model's: {len(unexpected)} unexpected "
                         f"(e.g. {unexpected[:3]}), {len(missing)} missing (e.g. {missing[:3]})")
    for name, tensor in state.items():
        if name in reference and tuple(tensor.shape) != reference[name]:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != served model {reference[name]}")


def check_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Raise ValueError unless `state` gives every parameter of `model` with the right shape.

    A name may be missing when it is tied to a present one (save_pretrained drops tied `lm_head.weight`).
    """
    own = model.state_dict()
    unexpected = sorted(set(state) - set(own))
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} names the model lacks, e.g. {unexpected[:3]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(own[name].shape)}"
            )
    aliases: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), set()).add(name)
    for names in aliases.values():
        if not names & set(state):
            raise ValueError(f"checkpoint lacks parameter {sorted(names)[0]!r}")


@torch.no_grad()
def copy_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` into `model`'s tensors in place (dtype cast to the model's); call `check_state` first."""
    own = model.state_dict()
    for name, tensor in state.items():
        own[name].copy_(tensor)
