"""Rollout batches as Arrow: the gateway's pages in, `Trajectory` objects out, and the bytes sent to other ranks.

At the recipe's size a batch is ~2,560 trajectories x ~2k tokens x (1 + K) log-probs; as JSON that is decimal text
parsed in Python on every step. Here the gateway's Arrow IPC pages (`GET /v1/batches/{id}/trajectories.arrow`,
columns in `sisrl.common.arrow_wire`) are checked and read page by page; a trajectory's arrays are read-only
views of its page's buffers (no text parser, no per-token Python object), and `collate_trajectories` places them
into the update's tensors a chunk at a time, so the trainer holds the pages and the tensors, not Python lists.
Rank 0 sends the trajectories it keeps to the other ranks as one Arrow IPC stream of the same schema
(`trajectories_to_ipc`).

Fail closed: a page whose body does not match its SHA-256 header, that is cut, has another schema, names another
batch or offset, or whose row count or per-row lengths disagree, raises GatewayError naming the batch and the
page; nothing of it is trained on.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np
import pyarrow as pa
import torch
from sisrl.common import arrow_wire
from sisrl.trainer.batch import RolloutBatch, Trajectory
from sisrl.trainer.gateway_client import DONE, GatewayClient, GatewayError

DEFAULT_PAGE_SIZE = 64  # trajectories a page; ~22 MB at 2k tokens and K = 20


def fetch_trajectories(http: httpx.Client, batch_id: str, *, page_size: int = DEFAULT_PAGE_SIZE) -> list[Trajectory]:
    """Every trajectory of a finished batch, page after page, in the batch's order; each page checked
    (`decode_page`), and together they must hold the batch's total exactly once."""
    out: list[Trajectory] = []
    offset, total = 0, None
    while total is None or offset < total:
        where = f"batch {batch_id} page offset={offset}"
        try:
            resp = http.get(f"/v1/batches/{batch_id}/trajectories.arrow", params={"offset": offset, "limit": page_size})
        except httpx.HTTPError as err:
            raise GatewayError(f"{where}: {err}") from err
        if resp.status_code >= 400:
            raise GatewayError(f"{where}: HTTP {resp.status_code}: {resp.text[:500]}")
        page = decode_page(resp.content, resp.headers, batch_id=batch_id, offset=offset)
        page_total = arrow_wire.meta_int(page, arrow_wire.META_TOTAL, where=where)
        if total is not None and page_total != total:
            raise GatewayError(f"{where}: the batch holds {page_total} trajectories, an earlier page said {total}")
        total = page_total
        if page.num_rows == 0 and offset < total:
            raise GatewayError(f"{where}: empty page before the end ({offset} of {total} trajectories read)")
        out.extend(page_trajectories(page))
        offset += page.num_rows
    ids = [t.id for t in out]
    if len(out) != total or len(set(ids)) != len(ids):
        raise GatewayError(f"batch {batch_id}: {len(out)} trajectories ({len(set(ids))} distinct) read in pages, "
                           f"the batch holds {total}")
    return out


def decode_page(raw: bytes, headers: httpx.Headers | dict[str, str], *, batch_id: str,
                offset: int) -> pa.RecordBatch:
    """The checked record batch of one page: its body hashes to the SHA-256 header, it is one complete IPC stream
    of our schema (`arrow_wire.read_page`), and it names this batch and offset with the header's row counts."""
    where = f"batch {batch_id} page offset={offset}"
    digest = headers.get(arrow_wire.HEADER_SHA256)
    if digest is None:
        raise GatewayError(f"{where}: no {arrow_wire.HEADER_SHA256} header")
    if hashlib.sha256(raw).hexdigest() != digest:
        raise GatewayError(f"{where}: the body ({len(raw)} bytes) does not match its SHA-256 header: cut or corrupted")
    try:
        page = arrow_wire.read_page(raw, where=where)
        named = (page.schema.metadata or {}).get(arrow_wire.META_BATCH, b"").decode()
        at = arrow_wire.meta_int(page, arrow_wire.META_OFFSET, where=where)
        total = arrow_wire.meta_int(page, arrow_wire.META_TOTAL, where=where)
    except arrow_wire.PageError as err:
        raise GatewayError(str(err)) from err
    if (named, at) != (batch_id, offset):
        raise GatewayError(f"{where}: the page is batch {named!r} offset {at}")
    said = (headers.get(arrow_wire.HEADER_ROWS), headers.get(arrow_wire.HEADER_TOTAL))
    if said != (str(page.num_rows), str(total)):
        raise GatewayError(f"{where}: headers say rows/total {said}, the page {page.num_rows}/{total}")
    return page


def page_trajectories(page: pa.RecordBatch) -> list[Trajectory]:
    """`Trajectory` objects of a checked page (row order kept). Their per-token fields are read-only numpy views
    of the page's buffers: no per-token Python object is made, and the page's memory is the batch's only copy
    until `collate_trajectories` places it. Values equal the JSON form's exactly (float32 log-probs widen to the
    same Python floats that their JSON decimal text parses to; `Trajectory.__eq__` compares either form)."""
    lists = {name: _ListColumn(page.column(name)) for name in
             ("prompt_ids", "response_ids", "loss_mask", "behaviour_logprobs", "topk_ids", "topk_logprobs",
              "token_versions")}
    scalars = {name: page.column(name).to_pylist() for name in
               ("id", "item_id", "group_id", "data_source", "topk_k", "policy_version", "reward", "reward_parts",
                "turns", "finish_reason", "answer", "error")}
    out = []
    for i in range(page.num_rows):
        k = scalars["topk_k"][i]
        out.append(Trajectory(
            id=scalars["id"][i], item_id=scalars["item_id"][i], group_id=scalars["group_id"][i],
            data_source=scalars["data_source"][i], prompt_ids=lists["prompt_ids"].row(i),
            response_ids=lists["response_ids"].row(i), loss_mask=lists["loss_mask"].row(i),
            behaviour_logprobs=lists["behaviour_logprobs"].row(i),
            topk_ids=lists["topk_ids"].row(i, k), topk_logprobs=lists["topk_logprobs"].row(i, k),
            reward=scalars["reward"][i], reward_parts=dict(scalars["reward_parts"][i]),
            turns=json.loads(scalars["turns"][i]), finish_reason=scalars["finish_reason"][i],
            answer=scalars["answer"][i], policy_version=scalars["policy_version"][i],
            token_versions=lists["token_versions"].row_or_none(i), error=scalars["error"][i],
        ))
    return out


class _ListColumn:
    """A list column as one numpy values array and its offsets (no copy), sliced per row."""

    def __init__(self, column: pa.ListArray) -> None:
        self.offsets = column.offsets.to_numpy()
        self.values = column.values.to_numpy(zero_copy_only=False)
        self.values.flags.writeable = False  # rows are views: nothing may write through them into the page
        self.valid = None if column.null_count == 0 else column.is_valid().to_numpy(zero_copy_only=False)

    def row(self, i: int, k: int | None = None) -> np.ndarray:
        """Row i as a view; with k, as a [T, K] view (a trajectory with K = 0 has a [0, 0] one)."""
        part = self.values[self.offsets[i]:self.offsets[i + 1]]
        if k is None:
            return part
        return part.reshape(-1, k) if k else part.reshape(0, 0)

    def flat(self) -> np.ndarray:
        """Every row's values, in order (the values buffer between the first and last offset)."""
        return self.values[self.offsets[0]:self.offsets[-1]]

    def row_or_none(self, i: int) -> np.ndarray | None:
        return None if self.valid is not None and not self.valid[i] else self.row(i)


# ---- record batch -> padded tensors ----------------------------------------------------------------------------
def collate_arrow(page: pa.RecordBatch, *, pad_id: int, k: int) -> RolloutBatch:
    """`batch.collate` straight from Arrow columns, vectorised: every token is placed by one numpy scatter per
    field instead of a Python loop over tokens. Same tensors, bit for bit (tests/services/test_batch_arrow.py),
    and the same refusals: per-row lengths that disagree (`arrow_wire.check_page`), a policy token with fewer
    than `k` recorded top-K entries."""
    if page.num_rows == 0:
        raise ValueError("collate needs at least one trajectory")
    arrow_wire.check_page(page, where="collate")
    n_p = np.diff(page.column("prompt_ids").offsets.to_numpy())
    n_r = np.diff(page.column("response_ids").offsets.to_numpy())
    out = _Padded(page.num_rows, int(n_p.max()), max(int(n_r.max()), 1), k, pad_id)
    out.place(page, 0)
    return out.batch()


def collate_trajectories(trajs: Sequence[Trajectory], *, pad_id: int, k: int,
                         chunk: int = DEFAULT_PAGE_SIZE) -> RolloutBatch:
    """`collate_arrow` of `trajs`, `chunk` trajectories at a time into tensors allocated once: the trainer's
    collate. Besides the tensors, memory holds one chunk's Arrow copy and scatter indices, never the batch
    twice (the trajectories' own arrays are views of the pages they came in)."""
    if not trajs:
        raise ValueError("collate needs at least one trajectory")
    p = max(len(t.prompt_ids) for t in trajs)
    t_len = max(max(len(t.response_ids) for t in trajs), 1)
    out = _Padded(len(trajs), p, t_len, k, pad_id)
    for start in range(0, len(trajs), chunk):
        page = trajectories_to_batch(trajs[start:start + chunk])
        arrow_wire.check_page(page, where=f"collate rows {start}-{start + page.num_rows - 1}")
        out.place(page, start)
    del page
    release_unused_memory()
    return out.batch()


class _Padded:
    """The numpy arrays of a RolloutBatch ([B, P+T] inputs, [B, T] per-token, [B, T, k] top-K), filled page by
    page (`place`), then wrapped as tensors without a copy (`batch`)."""

    def __init__(self, b: int, p: int, t_len: int, k: int, pad_id: int) -> None:
        self.p, self.k = p, k
        self.input_ids = np.full((b, p + t_len), pad_id, dtype=np.int64)
        self.attn = np.zeros((b, p + t_len), dtype=np.int64)
        self.response_ids = np.full((b, t_len), pad_id, dtype=np.int64)
        self.logq = np.zeros((b, t_len), dtype=np.float32)
        self.mask = np.zeros((b, t_len), dtype=np.float32)
        self.topk_ids = np.zeros((b, t_len, k), dtype=np.int64)
        self.topk_logq = np.zeros((b, t_len, k), dtype=np.float32)
        self.rewards = np.zeros(b, dtype=np.float32)
        self.group_ids: list[str] = [""] * b

    def place(self, page: pa.RecordBatch, row0: int) -> None:
        """Rows row0 .. row0 + len(page) - 1 from a checked page (its prompts and responses fit P and T)."""
        p = self.p
        prompt, resp = _ListColumn(page.column("prompt_ids")), _ListColumn(page.column("response_ids"))
        n_p, n_r = np.diff(prompt.offsets), np.diff(resp.offsets)
        # [tokens] row and column of each prompt token (left-padded) and response token (starting at column P)
        p_row, p_pos = _row_pos(n_p)
        r_row, r_pos = _row_pos(n_r)
        p_col = p - n_p[p_row] + p_pos
        self.input_ids[p_row + row0, p_col] = prompt.flat()
        self.attn[p_row + row0, p_col] = 1
        self.input_ids[r_row + row0, p + r_pos] = resp.flat()
        self.attn[r_row + row0, p + r_pos] = 1
        self.response_ids[r_row + row0, r_pos] = resp.flat()
        self.logq[r_row + row0, r_pos] = _ListColumn(page.column("behaviour_logprobs")).flat()
        policy = _ListColumn(page.column("loss_mask")).flat() != 0  # [tokens]
        self.mask[r_row[policy] + row0, r_pos[policy]] = 1.0
        _place_topk(page, r_row, r_pos, policy, self.topk_ids, self.topk_logq, row0, self.k)
        self.rewards[row0:row0 + page.num_rows] = page.column("reward").to_numpy()
        self.group_ids[row0:row0 + page.num_rows] = page.column("group_id").to_pylist()

    def batch(self) -> RolloutBatch:
        attn = torch.from_numpy(self.attn)
        position_ids = (attn.cumsum(dim=1) - 1).clamp(min=0)
        return RolloutBatch(
            torch.from_numpy(self.input_ids), attn, position_ids, torch.from_numpy(self.response_ids),
            torch.from_numpy(self.mask), torch.from_numpy(self.logq), torch.from_numpy(self.topk_ids),
            torch.from_numpy(self.topk_logq), torch.from_numpy(self.rewards), tuple(self.group_ids))


def _row_pos(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ragged rows of `lengths`: the row of each flat element and its index within the row."""
    rows = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.cumsum(lengths) - lengths
    return rows, np.arange(int(lengths.sum())) - starts[rows]


def _place_topk(page: pa.RecordBatch, r_row: np.ndarray, r_pos: np.ndarray, policy: np.ndarray,
                topk_ids: np.ndarray, topk_logq: np.ndarray, row0: int, k: int) -> None:
    """Into [B, T, k] top-K ids (int64) and log-probs (float32) at rows row0 ..: the first k of each policy
    token's recorded row (inserted tokens and padding keep their zeros)."""
    k_row = page.column("topk_k").to_numpy().astype(np.int64)
    short = policy & (k_row[r_row] < k)
    if short.any():
        i = int(short.nonzero()[0][0])
        row = int(r_row[i])
        raise ValueError(f"trajectory {page.column('id')[row].as_py()}: policy token {int(r_pos[i])} has a top-K "
                         f"row of {int(k_row[row])} entries, fewer than K={k} (algorithm.logprobs_k); ask the "
                         f"gateway for sampling.logprobs_k >= {k}")
    rows, cols = r_row[policy], r_pos[policy]
    for out, name in ((topk_ids, "topk_ids"), (topk_logq, "topk_logprobs")):
        col = _ListColumn(page.column(name))
        # [policy tokens, k] index of each kept entry in the values buffer: row start + token * K_row + j
        start = col.offsets[rows].astype(np.int64) + cols * k_row[rows]
        out[rows + row0, cols] = col.values[start[:, None] + np.arange(k)[None, :]]


def release_unused_memory() -> None:
    """Hand the memory Arrow's allocator (mimalloc or jemalloc) keeps from freed buffers back to the system. The
    collated tensors come from malloc, so without this a freed broadcast stays in RSS beside them."""
    pa.default_memory_pool().release_unused()


# ---- rank 0 -> other ranks -------------------------------------------------------------------------------------
def trajectories_to_ipc(trajs: Sequence[Trajectory]) -> bytes:
    """One Arrow IPC stream of `trajs` (metadata: no batch, offset 0, every row); the form rank 0 broadcasts.
    Log-probs travel as float32, the precision the gateway records and `collate` trains with (top-K log-probs
    as float16 when the gateway stored them rounded: the same values)."""
    return arrow_wire.to_stream(trajectories_to_batch(trajs))


def trajectories_to_batch(trajs: Sequence[Trajectory]) -> pa.RecordBatch:
    """`trajs` as one record batch of `arrow_wire.SCHEMA` or its SCHEMA_HALF_TOPK (see `trajectories_to_ipc`)."""
    blocks = [_topk_block(t) for t in trajs]
    columns: dict[str, pa.Array] = {
        "prompt_ids": _lists([t.prompt_ids for t in trajs], np.int32, pa.int32()),
        "response_ids": _lists([t.response_ids for t in trajs], np.int32, pa.int32()),
        "loss_mask": _lists([t.loss_mask for t in trajs], np.uint8, pa.uint8()),
        "behaviour_logprobs": _lists([t.behaviour_logprobs for t in trajs], np.float32, pa.float32()),
        "topk_k": pa.array([k for k, _, _ in blocks], pa.int32()),
        "topk_ids": _lists([ids for _, ids, _ in blocks], np.int32, pa.int32()),
        "topk_logprobs": _lists([lps for _, _, lps in blocks], np.float32, pa.float32()),
        "token_versions": _lists([t.token_versions for t in trajs], np.int32, pa.int32()),
        "policy_version": pa.array([t.policy_version for t in trajs], pa.int64()),
        "reward": pa.array([t.reward for t in trajs], pa.float64()),
        "reward_parts": pa.array([list(t.reward_parts.items()) for t in trajs], pa.map_(pa.string(), pa.float64())),
        "turns": pa.array([json.dumps(t.turns) for t in trajs], pa.string()),
    }
    for name in ("id", "item_id", "group_id", "data_source", "finish_reason", "answer", "error"):
        columns[name] = pa.array([getattr(t, name) for t in trajs], pa.string())
    meta = arrow_wire.metadata(batch_id="", offset=0, rows=len(trajs), total=len(trajs))
    schema = arrow_wire.narrow_topk(columns).with_metadata(meta)
    return pa.RecordBatch.from_arrays([columns[f.name] for f in schema], schema=schema)


def _topk_block(t: Trajectory) -> tuple[int, np.ndarray, np.ndarray]:
    """K and the [T, K] top-K arrays of `t`. A token the environment inserted may carry an empty row (nothing was
    sampled there); it becomes K zeros, which `collate` never reads (mask 0). A policy token's row must hold K."""
    if len(t.topk_ids) == 0:
        return 0, np.zeros(0, np.int32), np.zeros(0, np.float32)
    try:  # the common case, a rectangular block: no per-token Python
        ids, lps = np.asarray(t.topk_ids, np.int32), np.asarray(t.topk_logprobs, np.float32)
        if ids.ndim == 2 and ids.shape == lps.shape and len(ids) == len(t.loss_mask):
            return ids.shape[1], ids, lps
    except ValueError:  # ragged rows
        pass
    if not (len(t.topk_ids) == len(t.topk_logprobs) == len(t.loss_mask)):
        raise ValueError(f"trajectory {t.id}: {len(t.topk_ids)} top-K id rows, {len(t.topk_logprobs)} log-prob "
                         f"rows, {len(t.loss_mask)} tokens")
    k = max(len(row) for row in t.topk_ids)
    rows_ids, rows_lps = list(t.topk_ids), list(t.topk_logprobs)
    for i, (row, mask) in enumerate(zip(t.topk_ids, t.loss_mask, strict=True)):
        if not row and not mask:
            rows_ids[i], rows_lps[i] = [0] * k, [0.0] * k
        elif len(row) != k or len(t.topk_logprobs[i]) != k:
            raise ValueError(f"trajectory {t.id}: token {i} has a top-K row of {len(row)} ids and "
                             f"{len(t.topk_logprobs[i])} log-probs, the trajectory's K is {k}")
    return k, np.asarray(rows_ids, np.int32), np.asarray(rows_lps, np.float32)


def trajectories_from_ipc(raw: bytes) -> list[Trajectory]:
    """The trajectories of `trajectories_to_ipc` bytes, checked as a gateway page is."""
    return page_trajectories(arrow_wire.read_page(raw, where="broadcast batch page offset=0"))


def _lists(rows: Sequence[Sequence[Any] | np.ndarray | None], dtype: type[np.generic], kind: pa.DataType) -> pa.ListArray:
    """A list column from per-row sequences (nested [T][K] rows flatten row-major); None rows are null."""
    arrays = [np.asarray(r if r is not None else [], dtype=dtype).reshape(-1) for r in rows]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    values = pa.array(np.concatenate(arrays) if arrays else np.zeros(0, dtype), type=kind)
    nulls = [r is None for r in rows]
    mask = pa.array(nulls, pa.bool_()) if any(nulls) else None
    return pa.ListArray.from_arrays(pa.array(offsets), values, mask=mask)


# ---- the client's Arrow wait -----------------------------------------------------------------------------------
def wait_arrow(client: GatewayClient, batch_id: str, *, timeout_s: float, poll_s: float,
               body: dict[str, Any] | None = None, page_size: int = DEFAULT_PAGE_SIZE) -> list[Trajectory]:
    """Poll the batch's status without its trajectories; once done, read them as Arrow pages. A batch that ends
    otherwise (failed, partial) goes through `GatewayClient.wait`, which reports or keeps it as before."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = client._json("GET", f"/v1/batches/{batch_id}", params={"trajectories": "false"})
        status = str(got.get("status", "")).lower()
        if status == DONE:
            return fetch_trajectories(client.http, batch_id, page_size=page_size)
        if status != "running":  # failed (reported) or partial (resumed with `body`, else reported): as `wait`
            return client.wait(batch_id, timeout_s=max(deadline - time.monotonic(), poll_s), poll_s=poll_s, body=body)
        if time.monotonic() > deadline:
            raise GatewayError(f"batch {batch_id} not done after {timeout_s:.0f}s (progress {got.get('progress')})")
        time.sleep(poll_s)
