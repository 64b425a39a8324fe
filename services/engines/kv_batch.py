"""A running, left-padded decoding batch over a Hugging Face KV cache (continuous batching).

Rows join with `prefill` (their prompts run as one left-padded forward pass, then their cache is merged into the
running one) and leave with `keep`. Every row feeds exactly one token per `decode`. Shapes: B = rows, L = cache
length (padding included), H = KV heads, D = head size, V = vocabulary.

Left padding is exact: each row gets its own position ids (count of its real tokens) and the attention mask hides
the pad columns, so a row's logits do not depend on what else is in the batch (up to fp32 round-off). Keys are
cached after RoPE, so shifting a row's columns right when it is padded leaves its attention unchanged.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer


class KVBatch:
    """The running batch: one DynamicCache ([B, H, L, D] per layer) and its attention mask [B, L]."""

    def __init__(self, model: PreTrainedModel, pad_id: int) -> None:
        self.model = model
        self.pad_id = pad_id
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed `past_key_values` to `cache`; accept both releases.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.device = next(model.parameters()).device  # inputs, mask and cache live with the model
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # [B, L]; 1 = real, 0 = left pad
        self.forward_passes = 0

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        """One forward pass; returns the last position's logits [B, V] (the cache is updated in place)."""
        self.forward_passes += 1
        kwargs = {self._cache_kw: cache}
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **kwargs,
        )
        return out.logits[:, -1, :]

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Add rows for `prompts` (appended after the current rows). Returns their next-token logits [n, V]."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor(
            [[self.pad_id] * (width - len(p)) + p for p in prompts], dtype=torch.long
        )  # [n, P]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [n, P]; pads get 0, real tokens 0..len-1
        cache = DynamicCache()
        logits = self._forward(ids, mask, positions, cache)
        self._merge(cache, mask)
        return logits

    @torch.inference_mode()
    def decode(self, tokens: list[int]) -> torch.Tensor:
        """Feed one token per row (row order). Returns next-token logits [B, V]."""
        if len(tokens) != self.size or self.cache is None:
            raise ValueError(f"decode needs one token per row: got {len(tokens)} for {self.size} rows")
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device).unsqueeze(-1)  # [B, 1]
        positions = self.mask.sum(-1, keepdim=True)  # [B, 1] next position = count of real tokens
        self.mask = torch.cat([self.mask, torch.ones_like(positions)], dim=-1)  # [B, L + 1]
        return self._forward(ids, self.mask, positions, self.cache)

    @torch.inference_mode()
    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order) and drop pad columns no remaining row needs."""
        if not rows:
            self.cache, self.mask = None, torch.zeros(0, 0, dtype=torch.long, device=self.device)
            return
        if rows == list(range(self.size)):
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.mask = self.mask[index]
        start = int(self.mask.any(dim=0).long().argmax())  # first column some row still attends to
        self.mask = self.mask[:, start:]
        assert self.cache is not None
        self.cache = DynamicCache(
            ddp_cache_data=[(k[index, :, start:], v[index, :, start:]) for k, v in _kv(self.cache)]
        )

    def _merge(self, new: DynamicCache, new_mask: torch.Tensor) -> None:
        """Append `new`'s rows, left-padding whichever side is shorter so both share one length L."""
        if self.cache is None:
            self.cache, self.mask = new, new_mask
            return
        length = max(self.mask.shape[1], new_mask.shape[1])
        layers = []
        for (k0, v0), (k1, v1) in zip(_kv(self.cache), _kv(new), strict=True):
            layers.append(
                (
                    torch.cat([_lpad(k0, length), _lpad(k1, length)]),
                    torch.cat([_lpad(v0, length), _lpad(v1, length)]),
                )
            )
        self.cache = DynamicCache(ddp_cache_data=layers)
        self.mask = torch.cat([_lpad_mask(self.mask, length), _lpad_mask(new_mask, length)])


def _kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (keys, values) of every layer, each [B, H, L, D]; refuses caches this batch cannot re-pad."""
    out = []
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            raise ValueError(
                f"cache layer {i} is {type(layer).__name__}; the local engine needs full-attention layers"
            )
        assert layer.keys is not None and layer.values is not None, f"cache layer {i} is empty"
        out.append((layer.keys, layer.values))
    return out


def _lpad(t: torch.Tensor, length: int) -> torch.Tensor:
    """Left-pad a [B, H, L, D] tensor with zeros along L to `length`."""
    return F.pad(t, (0, 0, length - t.shape[-2], 0))


def _lpad_mask(mask: torch.Tensor, length: int) -> torch.Tensor:
    """Left-pad a [B, L] mask with zeros to `length`."""
    return F.pad(mask, (length - mask.shape[-1], 0))
