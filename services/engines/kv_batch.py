"""A running, left-padded decoding batch over a Hugging Face KV cache (continuous batching).

Rows join with `prefill` (their prompts run as one left-padded forward pass, then their cache is merged into the
running one) and leave with `keep`. Every row feeds exactly one token per `decode`. Shapes: B = rows, L = cache
length (padding included), H = KV heads, D = head size, V = vocabulary.

Left padding is exact: each row gets its own position ids (count of its real tokens) and the attention mask hides
the pad columns, so a row's logits do not depend on what else is in the batch (up to fp32 round-off). Keys are
cached after RoPE, so shifting a row's columns right when it is padded leaves its attention unchanged.

Every cache layer is a `GrowingLayer`: a decode step writes its one column into spare room instead of copying the
whole cache, as transformers' `DynamicLayer` does (`torch.cat` per layer per token).
"""

from __future__ import annotations

import inspect
from collections import OrderedDict

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

# Shorter common prefixes are not worth a forward pass of their own.
MIN_SHARED_PREFIX = 16


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
        self.shared_prefix_tokens = 0  # prompt tokens not prefilled because another row's prefix covered them

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
    def prefill(self, prompts: list[list[int]], pasts: list[RowKV | None] | None = None) -> torch.Tensor:
        """Add rows for `prompts` (appended after the current rows). Returns their next-token logits [n, V].

        `pasts[i]`, when given, is the cached KV of the first `pasts[i].length` tokens of `prompts[i]`
        (`PrefixCache.take`); only the rest of that prompt runs through the model. Identical (prompt, past)
        pairs, e.g. the samples of one GRPO group, run once and their rows are copied. The leading tokens that
        the distinct prompts without a past all share (an agent's instructions, before each question) run once
        too, as one row, and serve them as a common past (`shared_prefix_tokens` counts the tokens saved).
        """
        pasts = pasts if pasts is not None else [None] * len(prompts)
        keys = [(tuple(p), id(past)) for p, past in zip(prompts, pasts, strict=True)]
        first: dict[tuple[tuple[int, ...], int], int] = {}  # distinct (prompt, past) -> its row among the unique
        uniq: list[int] = []  # index of each distinct row's first occurrence
        for i, key in enumerate(keys):
            if key not in first:
                first[key] = len(uniq)
                uniq.append(i)
        inverse = torch.tensor([first[key] for key in keys], dtype=torch.long, device=self.device)
        u_prompts, u_pasts = [prompts[i] for i in uniq], [pasts[i] for i in uniq]
        u_pasts = self._share_prefix(u_prompts, u_pasts)
        cut = [past.length if past is not None else 0 for past in u_pasts]
        suffix = [p[c:] for p, c in zip(u_prompts, cut, strict=True)]
        width = max(len(x) for x in suffix)
        ids = torch.tensor([[self.pad_id] * (width - len(x)) + x for x in suffix], dtype=torch.long)  # [u, S]
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in suffix], dtype=torch.long)
        ids, mask = ids.to(self.device), mask.to(self.device)
        start = torch.tensor(cut, dtype=torch.long, device=self.device).unsqueeze(-1)  # [u, 1] tokens cached
        positions = (start + mask.cumsum(-1) - 1).clamp(min=0)  # [u, S]; pads (masked) get start - 1
        cache, past_mask = self._past_cache(u_pasts)
        if past_mask is not None:
            mask = torch.cat([past_mask, mask], dim=-1)  # [u, Lp + S]: pads between past and suffix are masked
        logits = self._forward(ids, mask, positions, cache)
        if len(uniq) < len(prompts):  # copy the shared rows
            cache = _cache([(k[inverse], v[inverse]) for k, v in _kv(cache)])
            mask, logits = mask[inverse], logits[inverse]
        self._merge(cache, mask)
        return logits

    def _share_prefix(self, prompts: list[list[int]], pasts: list[RowKV | None]) -> list[RowKV | None]:
        """`pasts` with the longest prefix common to the prompts that have none (if >= MIN_SHARED_PREFIX tokens,
        one token short of the shortest so each row keeps one to produce its logits) filled in, computed once."""
        fresh = [i for i, past in enumerate(pasts) if past is None]
        if len(fresh) < 2:
            return pasts
        first = prompts[fresh[0]]
        limit = min(len(prompts[i]) for i in fresh) - 1
        shared = 0
        while shared < limit and all(prompts[i][shared] == first[shared] for i in fresh):
            shared += 1
        if shared < MIN_SHARED_PREFIX:
            return pasts
        ids = torch.tensor([first[:shared]], dtype=torch.long, device=self.device)  # [1, shared]
        cache = _cache([])
        self._forward(ids, torch.ones_like(ids), torch.arange(shared, device=self.device).unsqueeze(0), cache)
        past = RowKV([(k[0], v[0]) for k, v in _kv(cache)])  # [H, shared, D] per layer
        self.shared_prefix_tokens += shared * (len(fresh) - 1)
        return [past if i in fresh else p for i, p in enumerate(pasts)]

    def _past_cache(self, pasts: list[RowKV | None]) -> tuple[DynamicCache, torch.Tensor | None]:
        """A cache holding each row's cached prefix, left-padded to the longest, and its mask; empty if none."""
        length = max((past.length for past in pasts if past is not None), default=0)
        if length == 0:
            return _cache([]), None
        ref = next(past for past in pasts if past is not None)
        layers = []
        for li, (k_ref, _) in enumerate(ref.layers):
            shape = (len(pasts), k_ref.shape[0], length, k_ref.shape[-1])
            keys = torch.zeros(shape, dtype=k_ref.dtype, device=self.device)
            values = torch.zeros_like(keys)
            for row, past in enumerate(pasts):
                if past is not None:
                    keys[row, :, length - past.length:] = past.layers[li][0]
                    values[row, :, length - past.length:] = past.layers[li][1]
            layers.append((keys, values))
        mask = torch.zeros(len(pasts), length, dtype=torch.long, device=self.device)
        for row, past in enumerate(pasts):
            if past is not None:
                mask[row, length - past.length:] = 1
        return _cache(layers), mask

    def row_kv(self, row: int) -> RowKV:
        """The cached keys/values of one row's real tokens (its prompt and every token fed since)."""
        assert self.cache is not None
        cols = self.mask[row].bool()
        return RowKV([(k[row][:, cols].clone(), v[row][:, cols].clone()) for k, v in _kv(self.cache)])

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
        self.cache = _cache([(k[index, :, start:], v[index, :, start:]) for k, v in _kv(self.cache)])

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
        self.cache = _cache(layers)
        self.mask = torch.cat([_lpad_mask(self.mask, length), _lpad_mask(new_mask, length)])


class RowKV:
    """One sequence's keys and values per layer, each [H, n, D] (n = `length` tokens, no padding)."""

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.layers = layers
        self.length = int(layers[0][0].shape[1]) if layers else 0


class PrefixCache:
    """KV of finished generations, keyed by the tokens they cover, so a request that continues one (the next
    turn of an agent: the same prompt and response, then the observation) prefills only its new tokens.

    Bounded by `max_tokens` (oldest out first); an entry is taken (removed) when reused, since each
    trajectory continues once. `clear()` after a weight swap: a cache computed under other weights is stale.
    """

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"prefix cache max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[int, ...], RowKV] = OrderedDict()
        self._tokens = 0
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tokens: list[int], kv: RowKV) -> None:
        if kv.length != len(tokens):
            raise ValueError(f"prefix cache: {len(tokens)} tokens but KV for {kv.length}")
        if not self.max_tokens or kv.length > self.max_tokens:
            return
        key = tuple(tokens)
        if key in self._entries:
            self._tokens -= self._entries.pop(key).length
        self._entries[key] = kv
        self._tokens += kv.length
        while self._tokens > self.max_tokens:
            self._tokens -= self._entries.popitem(last=False)[1].length

    def take(self, prompt: list[int]) -> RowKV | None:
        """Remove and return the longest entry that is a proper prefix of `prompt` (at least one new token
        must remain to produce logits), or None."""
        best: tuple[int, ...] | None = None
        for key in self._entries:
            if len(key) < len(prompt) and (best is None or len(key) > len(best)) and tuple(prompt[: len(key)]) == key:
                best = key
        if best is None:
            return None
        kv = self._entries.pop(best)
        self._tokens -= kv.length
        self.hits += 1
        self.reused_tokens += kv.length
        return kv

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer whose keys and values are views of the first L columns of [B, H, capacity, D]
    buffers. `update` writes the new columns in place and reallocates (with room to spare) only when full, where
    `DynamicLayer` concatenates: it copies the whole [B, H, L, D] cache of every layer for every decoded token
    (SmolLM2-135M, 16 rows of 400 tokens: ~0.3 GB a step)."""

    SPARE = 64  # columns of room added on each reallocation (or a quarter of the length, if more)

    def __init__(self) -> None:
        super().__init__()
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor) -> GrowingLayer:
        layer = cls()
        layer.update(keys, values)
        return layer

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self.get_seq_length(), key_states.shape[-2]
        keys, values = self._key_buffer, self._value_buffer
        # Reallocate when full, and whenever the keys were replaced from outside (transformers' crop or
        # batch_select_indices assign new tensors): they are then no longer a view of the buffer.
        if keys is None or values is None or length + new > keys.shape[-2] or keys.shape[0] != key_states.shape[0] \
                or (length and _data_ptr(self.keys) != keys.data_ptr()):
            capacity = length + new + max(self.SPARE, length // 4)
            shape = (*key_states.shape[:2], capacity, key_states.shape[-1])
            keys = key_states.new_empty(shape)
            values = value_states.new_empty((*shape[:3], value_states.shape[-1]))
            if length:
                assert isinstance(self.keys, torch.Tensor) and isinstance(self.values, torch.Tensor)
                keys[:, :, :length] = self.keys
                values[:, :, :length] = self.values
            self._key_buffer, self._value_buffer = keys, values
        keys[:, :, length:length + new] = key_states
        values[:, :, length:length + new] = value_states
        self.keys, self.values = keys[:, :, :length + new], values[:, :, :length + new]
        return keys[:, :, :length + new], values[:, :, :length + new]


def _data_ptr(t: object) -> int:
    return t.data_ptr() if isinstance(t, torch.Tensor) else -1


def _cache(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A DynamicCache of GrowingLayers holding `layers` ((keys, values) per layer); empty when `layers` is, and
    then filled by the model's first forward pass, one GrowingLayer per decoder layer."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    cache.layers = [GrowingLayer.holding(k, v) for k, v in layers]
    return cache


def _kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (keys, values) of every layer, each [B, H, L, D]; refuses caches this batch cannot re-pad."""
    out = []
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, DynamicLayer) or type(layer) not in (DynamicLayer, GrowingLayer):
            raise ValueError(
                f"cache layer {i} is {type(layer).__name__}; the local engine needs full-attention layers"
            )
        keys, values = layer.keys, layer.values
        assert isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor), f"cache layer {i} is empty"
        out.append((keys, values))
    return out


def _lpad(t: torch.Tensor, length: int) -> torch.Tensor:
    """Left-pad a [B, H, L, D] tensor with zeros along L to `length`."""
    return F.pad(t, (0, 0, length - t.shape[-2], 0))


def _lpad_mask(mask: torch.Tensor, length: int) -> torch.Tensor:
    """Left-pad a [B, L] mask with zeros to `length`."""
    return F.pad(mask, (length - mask.shape[-1], 0))
