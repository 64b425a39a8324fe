"""Trajectories as Arrow IPC: the binary form of a batch between gateway and trainer (docs/gateway.md, "Arrow").

One definition of the columns, read by both sides: the gateway writes pages of a stored batch in this schema
(`services/arrow_pages.py`), the trainer reads them and sends the same form to its other ranks
(`trainer/arrow_batch.py`). A page is one Arrow IPC *stream* (a schema message, one record batch, the
end-of-stream marker), as specified in https://arrow.apache.org/docs/format/Columnar.html#ipc-streaming-format.

Per-token columns are Arrow lists of one trajectory's response: ids int32, mask uint8, log-probs float32. The top-K
block of a trajectory is its flattened [T, K] row-major array with K in `topk_k` (0 for a trajectory with no
tokens), so a reader reshapes without copying. Its log-probs travel as float16 in a page whose every top-K value is
a half float exactly (a gateway with `topk_logprobs_dtype: float16` stores them so: `round_to_half`), else as
float32; either widens to the same float32 values, so the JSON and Arrow forms agree bit for bit. The schema's
metadata names the batch and the page; a reader checks them, and every per-row length, before it trusts a value
(`check_page`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

MEDIA_TYPE = "application/vnd.apache.arrow.stream"
FORMAT = "sisrl-trajectories/1"

# Schema metadata keys (bytes, as Arrow stores them); values are UTF-8 text.
META_FORMAT = b"sisrl.format"
META_BATCH = b"sisrl.batch_id"  # the gateway batch, or "" for a trainer's broadcast
META_OFFSET = b"sisrl.offset"  # index of the page's first trajectory in the batch (insertion order)
META_ROWS = b"sisrl.rows"  # trajectories in this page
META_TOTAL = b"sisrl.total"  # trajectories in the whole batch

# Response headers of a page: the same numbers, and the SHA-256 of the body (a flipped byte is refused).
HEADER_TOTAL = "X-Sisrl-Total"
HEADER_ROWS = "X-Sisrl-Rows"
HEADER_NEXT = "X-Sisrl-Next-Offset"  # absent on the last page
HEADER_SHA256 = "X-Sisrl-Sha256"

SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("item_id", pa.string(), nullable=False),
    pa.field("group_id", pa.string(), nullable=False),
    pa.field("data_source", pa.string(), nullable=False),
    pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("response_ids", pa.list_(pa.int32()), nullable=False),  # [T]
    pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),  # [T] 1 = policy token
    pa.field("behaviour_logprobs", pa.list_(pa.float32()), nullable=False),  # [T] log q(y_t)
    pa.field("topk_k", pa.int32(), nullable=False),  # K of this trajectory's top-K block
    pa.field("topk_ids", pa.list_(pa.int32()), nullable=False),  # [T * K] row-major [T, K]
    pa.field("topk_logprobs", pa.list_(pa.float32()), nullable=False),  # [T * K]
    pa.field("token_versions", pa.list_(pa.int32()), nullable=True),  # [T] -1 where inserted; null: all policy_version
    pa.field("policy_version", pa.int64(), nullable=False),
    pa.field("reward", pa.float64(), nullable=False),
    pa.field("reward_parts", pa.map_(pa.string(), pa.float64()), nullable=False),
    pa.field("turns", pa.string(), nullable=False),  # JSON list of {query, doc_ids, scores}
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("answer", pa.string(), nullable=True),
    pa.field("error", pa.string(), nullable=True),
])

# The same columns with the top-K log-probs as half floats (`narrow_topk`).
SCHEMA_HALF_TOPK = SCHEMA.set(SCHEMA.get_field_index("topk_logprobs"),
                              pa.field("topk_logprobs", pa.list_(pa.float16()), nullable=False))

_PER_TOKEN = ("loss_mask", "behaviour_logprobs")


def round_to_half(values: Any) -> list[Any]:
    """Log-probs (nested lists or an array) rounded to the nearest float16, as float32 lists: what a gateway
    with `topk_logprobs_dtype: float16` stores."""
    return np.asarray(values, np.float32).astype(np.float16).astype(np.float32).tolist()  # type: ignore[no-any-return]


def narrow_topk(columns: dict[str, pa.Array]) -> pa.Schema:
    """Put `columns["topk_logprobs"]` (float32 lists) in float16 when every value is a half float exactly; the
    schema the columns then follow (SCHEMA or SCHEMA_HALF_TOPK, no metadata)."""
    lists = columns["topk_logprobs"]
    values = lists.values.to_numpy(zero_copy_only=False)
    half = values.astype(np.float16)
    if not np.array_equal(half.astype(np.float32), values):
        return SCHEMA
    columns["topk_logprobs"] = pa.ListArray.from_arrays(lists.offsets, pa.array(half))
    return SCHEMA_HALF_TOPK


class PageError(ValueError):
    """A page that cannot be trusted (cut, corrupted, another schema or batch, lengths that disagree); the
    message names the batch and the page."""


def metadata(*, batch_id: str, offset: int, rows: int, total: int) -> dict[bytes, bytes]:
    return {META_FORMAT: FORMAT.encode(), META_BATCH: batch_id.encode(), META_OFFSET: str(offset).encode(),
            META_ROWS: str(rows).encode(), META_TOTAL: str(total).encode()}


def to_stream(batch: pa.RecordBatch) -> bytes:
    """One IPC stream holding `batch` (its schema carries the metadata), its buffers zstd-compressed (the IPC
    format's own buffer compression: any Arrow reader opens it; token ids and top-K ids shrink most)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def read_page(raw: bytes, *, where: str) -> pa.RecordBatch:
    """The single record batch of an IPC stream, checked (`check_page`); `where` names it in errors
    ("batch b-1 page offset=0")."""
    try:
        reader = pa.ipc.open_stream(pa.BufferReader(raw))
        batches = list(reader)
    except (pa.ArrowException, OSError) as err:  # cut bytes end mid-message; garbage is an invalid message
        raise PageError(f"{where}: not a complete Arrow IPC stream ({len(raw)} bytes): {err}") from err
    if len(batches) != 1:
        raise PageError(f"{where}: {len(batches)} record batches in the stream, expected 1")
    check_page(batches[0], where=where)
    return batches[0]


def check_page(batch: pa.RecordBatch, *, where: str) -> None:
    """Refuse a page whose schema, format tag or row count disagree with this module, or whose per-row lengths
    disagree with each other (a response of T tokens has T mask / log-prob / version entries and T * K top-K)."""
    if not (batch.schema.equals(SCHEMA, check_metadata=False)
            or batch.schema.equals(SCHEMA_HALF_TOPK, check_metadata=False)):
        raise PageError(f"{where}: schema differs from {FORMAT}: got {batch.schema.remove_metadata()}")
    meta = batch.schema.metadata or {}
    if meta.get(META_FORMAT) != FORMAT.encode():
        raise PageError(f"{where}: format tag {meta.get(META_FORMAT)!r}, expected {FORMAT!r}")
    rows = meta_int(batch, META_ROWS, where=where)
    if rows != batch.num_rows:
        raise PageError(f"{where}: the page header says {rows} trajectories, the record batch holds {batch.num_rows}")
    try:
        batch.validate(full=True)  # offsets inside their buffers, no bad UTF-8: what a flipped byte may break
    except pa.ArrowInvalid as err:
        raise PageError(f"{where}: invalid record batch: {err}") from err
    n = batch.column("response_ids").value_lengths().to_numpy(zero_copy_only=False)
    for name in _PER_TOKEN:
        _same_lengths(batch, name, n, where)
    versions = batch.column("token_versions")
    if versions.null_count < len(versions):
        lengths = versions.value_lengths().to_numpy(zero_copy_only=False)
        present = ~versions.is_null().to_numpy(zero_copy_only=False)
        if (lengths[present] != n[present]).any():
            raise PageError(f"{where}: token_versions lengths differ from response_ids")
    k = batch.column("topk_k").to_numpy()
    if (k < 0).any():
        raise PageError(f"{where}: negative topk_k")
    for name in ("topk_ids", "topk_logprobs"):
        _same_lengths(batch, name, n * k, where)


def _same_lengths(batch: pa.RecordBatch, name: str, expected: object, where: str) -> None:
    got = batch.column(name).value_lengths().to_numpy(zero_copy_only=False)
    bad = (got != expected).nonzero()[0]
    if len(bad):
        row = int(bad[0])
        raise PageError(f"{where}: trajectory {batch.column('id')[row].as_py()!r} (row {row}) has {int(got[row])} "
                        f"{name} entries, expected {int(expected[row])}")  # type: ignore[index]


def meta_int(batch: pa.RecordBatch, key: bytes, *, where: str) -> int:
    raw = (batch.schema.metadata or {}).get(key)
    if raw is None:
        raise PageError(f"{where}: no {key.decode()} in the schema metadata")
    try:
        return int(raw)
    except ValueError:
        raise PageError(f"{where}: metadata {key.decode()} is {raw!r}, expected an integer") from None
