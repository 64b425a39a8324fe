"""Pages of a stored batch as Arrow IPC streams (`GET /v1/batches/{id}/trajectories.arrow`).

The store keeps every token array as little-endian numpy bytes (services/store.py); a page joins a column's
blobs and hands the bytes to Arrow as one values buffer with the offsets beside it, so no token passes through a
Python list. The columns and metadata are `sisrl.common.arrow_wire.SCHEMA`'s (docs/gateway.md, "Arrow").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
from sisrl.common import arrow_wire
from sqlalchemy.engine import Row

# blob column -> (numpy dtype as stored, Arrow value type)
_BLOBS: dict[str, tuple[np.dtype[Any], pa.DataType]] = {
    "prompt_ids": (np.dtype("<i4"), pa.int32()),
    "response_ids": (np.dtype("<i4"), pa.int32()),
    "loss_mask": (np.dtype("u1"), pa.uint8()),
    "behaviour_logprobs": (np.dtype("<f4"), pa.float32()),
    "topk_ids": (np.dtype("<i4"), pa.int32()),
    "topk_logprobs": (np.dtype("<f4"), pa.float32()),
}


def page_batch(rows: Sequence[Row[Any]], *, batch_id: str, offset: int, total: int) -> pa.RecordBatch:
    """The record batch of `rows` (store.PAGE_COLUMNS, in the batch's order) with the page's metadata."""
    columns: dict[str, pa.Array] = {name: _blob_lists([getattr(r, name) for r in rows], *kind)
                                    for name, kind in _BLOBS.items()}
    base = arrow_wire.narrow_topk(columns)  # stored rounded (topk_logprobs_dtype float16): 2 bytes a value
    columns["token_versions"] = _versions(rows)
    for name in ("id", "item_id", "group_id", "data_source", "finish_reason", "answer", "error"):
        columns[name] = pa.array([getattr(r, name) for r in rows], pa.string())
    columns["topk_k"] = pa.array([r.topk_k for r in rows], pa.int32())
    columns["policy_version"] = pa.array([r.policy_version for r in rows], pa.int64())
    columns["reward"] = pa.array([r.reward for r in rows], pa.float64())
    columns["reward_parts"] = pa.array([[("em", r.em), ("f1", r.f1), ("format", r.format)] for r in rows],
                                       pa.map_(pa.string(), pa.float64()))
    columns["turns"] = pa.array([json.dumps(r.turns) for r in rows], pa.string())
    schema = base.with_metadata(
        arrow_wire.metadata(batch_id=batch_id, offset=offset, rows=len(rows), total=total))
    return pa.RecordBatch.from_arrays([columns[f.name] for f in schema], schema=schema)


def _blob_lists(blobs: Sequence[bytes], dtype: np.dtype[Any], kind: pa.DataType) -> pa.ListArray:
    """One list per blob: the blobs joined are the values buffer (one copy), their lengths give the offsets."""
    lengths = np.fromiter((len(b) // dtype.itemsize for b in blobs), dtype=np.int64, count=len(blobs))
    offsets = np.zeros(len(blobs) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.frombuffer(b"".join(blobs), dtype=dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=kind))


def _versions(rows: Sequence[Row[Any]]) -> pa.ListArray:
    """token_versions as stored; a row stored before that column existed gets `policy_version` at its policy
    tokens and -1 elsewhere, as the JSON form (`store.to_trajectory`) gives it."""
    blobs = [r.token_versions if r.token_versions is not None
             else np.where(np.frombuffer(r.loss_mask, np.uint8) > 0, r.policy_version, -1).astype("<i4").tobytes()
             for r in rows]
    return _blob_lists(blobs, np.dtype("<i4"), pa.int32())
