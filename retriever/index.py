"""Build and load a FAISS index over a passage corpus.

`build_index` runs in four resumable stages inside one output directory:
1. the document store (`docs.jsonl` + `offsets.int64`, see docstore.py) and the corpus checksum;
2. passage embeddings, encoded in shards of `shard_size` rows, each saved as `shards/emb_NNNNN.npy` by
   temp-file + rename, so a crash at 90 % of wiki-18 loses at most one shard;
3. the FAISS index (`index.faiss`) from the shards: IndexFlatIP (exact), HNSW, or an IVF index (IVF-PQ, IVF-SQ8,
   OPQ + IVF-PQ) whose quantiser is trained on `train_sample` rows and whose codes are added shard by shard from
   memory-mapped shards, so peak RAM is the index itself plus one shard, not the corpus's embeddings;
4. `manifest.json`, written last: its presence marks a complete index.
A stop request (SIGINT/SIGTERM set `stop`) ends the build between encoder batches; finished shards stay.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from sisrl.common.atomic import atomic_path, write_json
from sisrl.retriever.corpus import ReadStats, file_sha256, iter_passages
from sisrl.retriever.docstore import DocStore, DocStoreWriter
from sisrl.retriever.encoder import Encoder
from sisrl.retriever.manifest import FAISS_FILE, EncoderSpec, Manifest

logger = logging.getLogger(__name__)

INDEX_TYPES = ("flat", "hnsw", "ivfpq", "ivfsq8", "opq-ivfpq")
STATE_FILE = "build_state.json"
SHARD_DIR = "shards"


@dataclass(frozen=True)
class BuildConfig:
    """Options of `sisrl-retriever build` (the encoder has its own EncoderConfig)."""

    corpus: Path = field(metadata={"help": "passage corpus, JSONL or JSONL.gz of {id, contents}"})
    out: Path = field(metadata={"help": "index directory to create (an unfinished build there is resumed)"})
    index: str = field(default="flat", metadata={"help": "flat (exact IndexFlatIP) | hnsw | ivfpq | ivfsq8 (8-bit "
                                                 "scalar codes) | opq-ivfpq (OPQ rotation, then IVF-PQ)"})
    shard_size: int = field(default=8192, metadata={"help": "passages per embedding shard saved to disk"})
    skip_bad: bool = field(default=False, metadata={"help": "skip and count bad corpus lines instead of stopping"})
    hnsw_m: int = field(default=32, metadata={"help": "HNSW: neighbours per node"})
    hnsw_ef_construction: int = field(default=200, metadata={"help": "HNSW: candidate list size while building"})
    ivf_nlist: int = field(default=0, metadata={"help": "IVF types: inverted lists; 0 = 4 * sqrt(passages)"})
    train_sample: int = field(default=0, metadata={"help": "IVF types: rows the quantisers are trained on, evenly "
                                                   "spaced over the corpus; 0 = max(39 * nlist, 39 * 2**pq_nbits)"})
    pq_m: int = field(default=16, metadata={"help": "ivfpq / opq-ivfpq: sub-quantisers (must divide the dimension)"})
    pq_nbits: int = field(default=8, metadata={"help": "ivfpq / opq-ivfpq: bits per sub-quantiser code"})
    faiss_gpu: bool = field(default=False, metadata={"help": "train ivfpq / ivfsq8 on the GPUs when faiss-gpu is "
                                                     "installed"})
    length_sort: bool = field(default=True, metadata={"help": "form encoder batches from passages sorted by token "
                                                      "length within each shard (row order unchanged)"})

    def __post_init__(self) -> None:
        if self.index not in INDEX_TYPES:
            raise ValueError(f"BuildConfig.index: unknown index type {self.index!r}, expected one of {INDEX_TYPES}")
        for name in ("shard_size", "hnsw_m", "hnsw_ef_construction", "pq_m", "pq_nbits"):
            if getattr(self, name) < 1:
                raise ValueError(f"BuildConfig.{name}: expected a positive int, got {getattr(self, name)!r}")
        for name in ("ivf_nlist", "train_sample"):
            if getattr(self, name) < 0:
                raise ValueError(f"BuildConfig.{name}: expected >= 0 (0 = automatic), got {getattr(self, name)!r}")
        if self.faiss_gpu and self.index == "opq-ivfpq":
            raise ValueError("BuildConfig.faiss_gpu: GPU training covers ivfpq and ivfsq8, not opq-ivfpq")


@dataclass
class BuildResult:
    stopped: bool
    count: int
    shards_done: int
    shards_total: int
    skipped_lines: int


Progress = Callable[[int], None]


def build_index(cfg: BuildConfig, encoder: Encoder, *, stop: threading.Event | None = None,
                progress: Callable[[int, int], Progress] | None = None) -> BuildResult:
    """Build (or resume building) the index described by `cfg` with `encoder`.

    `progress(total, already_done)` returns a callback that is told how many passages each step encoded.
    """
    stop = stop or threading.Event()
    cfg.out.mkdir(parents=True, exist_ok=True)
    state = _docstore_stage(cfg, encoder)
    store = DocStore(cfg.out)
    try:
        count = len(store)
        if count == 0:
            raise ValueError(f"corpus {str(cfg.corpus)!r} holds no passages")
        shards_total = math.ceil(count / cfg.shard_size)
        done = _encode_stage(cfg, encoder, store, stop, progress)
    finally:
        store.close()
    result = BuildResult(stopped=stop.is_set(), count=count, shards_done=done, shards_total=shards_total,
                         skipped_lines=int(state["skipped"]))
    if result.stopped:
        logger.warning("build stopped: %d of %d shards saved under %s; run the same command to resume",
                       done, shards_total, cfg.out / SHARD_DIR)
        return result
    params = _faiss_stage(cfg, encoder.dim, shards_total)
    Manifest(
        encoder=EncoderSpec(model=encoder.cfg.model, query_prefix=encoder.query_prefix,
                            passage_prefix=encoder.passage_prefix, max_length=encoder.max_length),
        encoder_identity=dict(encoder.identity), dim=encoder.dim, count=count, index_type=cfg.index,
        index_params=params, corpus_path=str(cfg.corpus), corpus_sha256=str(state["sha256"]),
        corpus_skipped_lines=int(state["skipped"]), build_dtype=encoder.dtype,
        build_backend=encoder.backend,
    ).save(cfg.out)
    logger.info("index of %d passages written to %s", count, cfg.out)
    return result


def _docstore_stage(cfg: BuildConfig, encoder: Encoder) -> dict[str, Any]:
    """Write the document store unless a finished one for the same corpus and encoder is there already."""
    state_path = cfg.out / STATE_FILE
    wanted = {"encoder_identity": dict(encoder.identity), "shard_size": cfg.shard_size}
    if state_path.is_file():
        state: dict[str, Any] = json.loads(state_path.read_text())
        sha = file_sha256(cfg.corpus)
        if state.get("sha256") != sha:
            raise ValueError(f"{cfg.out} holds an unfinished build of another corpus (sha256 {state.get('sha256')}, "
                             f"{cfg.corpus} has {sha}); use an empty --out directory")
        for key, value in wanted.items():
            if state.get(key) != value:
                raise ValueError(f"{cfg.out} holds an unfinished build with {key}={state.get(key)!r}, "
                                 f"this build has {value!r}; use an empty --out directory or the same options")
        logger.info("resuming the build in %s", cfg.out)
        return state
    stats = ReadStats()
    writer = DocStoreWriter(cfg.out)
    try:
        for passage in iter_passages(cfg.corpus, skip_bad=cfg.skip_bad, stats=stats):
            writer.add(passage)
    except BaseException:
        writer.abort()
        raise
    writer.commit()
    if stats.skipped:
        logger.warning("skipped %d bad corpus lines, e.g. %s", stats.skipped, stats.skipped_examples[:3])
    state = {**wanted, "sha256": stats.sha256, "count": writer.count, "skipped": stats.skipped}
    write_json(state_path, state)
    return state


def shard_path(out: Path, shard: int) -> Path:
    return out / SHARD_DIR / f"emb_{shard:05d}.npy"


def _encode_stage(cfg: BuildConfig, encoder: Encoder, store: DocStore, stop: threading.Event,
                  progress: Callable[[int, int], Progress] | None) -> int:
    """Encode every shard not yet on disk; return the number of shards on disk when done or stopped."""
    (cfg.out / SHARD_DIR).mkdir(exist_ok=True)
    count = len(store)
    starts = range(0, count, cfg.shard_size)
    missing = [i for i, _ in enumerate(starts) if not shard_path(cfg.out, i).is_file()]
    done_rows = count - sum(min(cfg.shard_size, count - i * cfg.shard_size) for i in missing)
    tick: Progress = progress(count, done_rows) if progress else (lambda n: None)
    step = encoder.cfg.batch_size  # check for a stop request after every encoder batch
    for shard in missing:
        start, stop_row = shard * cfg.shard_size, min(count, (shard + 1) * cfg.shard_size)
        if shard_path(cfg.out, shard).is_file():  # written meanwhile by another builder on the same directory
            tick(stop_row - start)
            continue
        texts = [p.contents for p in store.iter_range(start, stop_row)]
        vectors = _encode_rows(encoder, texts, step, cfg.length_sort, stop, tick)
        if vectors is None:
            return len(starts) - len(missing) + missing.index(shard)
        with atomic_path(shard_path(cfg.out, shard)) as tmp, tmp.open("wb") as handle:
            np.save(handle, vectors)
    return len(starts)


def _encode_rows(encoder: Encoder, texts: list[str], step: int, length_sort: bool, stop: threading.Event,
                 tick: Progress) -> np.ndarray | None:
    """`[len(texts), dim]` float32 in the rows' own order, encoded `step` at a time; None when stopped.

    With `length_sort` the batches are cut from the rows sorted by token length, then scattered back.
    """
    order = encoder.passage_length_order(texts) if length_sort else np.arange(len(texts))
    out = np.empty((len(texts), encoder.dim), dtype=np.float32)  # [rows, dim]
    for offset in range(0, len(texts), step):
        if stop.is_set():
            return None
        rows = order[offset:offset + step]
        out[rows] = encoder.encode_passages([texts[i] for i in rows])
        tick(len(rows))
    return out


def _faiss_stage(cfg: BuildConfig, dim: int, shards_total: int) -> dict[str, int]:
    import faiss

    def shards() -> list[np.ndarray]:
        return [np.load(shard_path(cfg.out, i), mmap_mode="r") for i in range(shards_total)]

    count = sum(s.shape[0] for s in shards())
    params: dict[str, int] = {}
    index: Any
    if cfg.index == "flat":
        index = faiss.IndexFlatIP(dim)
    elif cfg.index == "hnsw":
        index = faiss.IndexHNSWFlat(dim, cfg.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = cfg.hnsw_ef_construction
        params = {"hnsw_m": cfg.hnsw_m, "hnsw_ef_construction": cfg.hnsw_ef_construction}
    else:
        index, params = _trained_ivf(cfg, dim, count, shards())
    for vectors in shards():
        index.add(np.ascontiguousarray(vectors, dtype=np.float32))
    with atomic_path(cfg.out / FAISS_FILE) as tmp:
        faiss.write_index(index, str(tmp))
    return params


def ivf_train_rows(cfg: BuildConfig, count: int, nlist: int) -> int:
    """Rows to train on: FAISS wants ~39 points per centroid (and per PQ codebook entry), capped at the corpus."""
    return min(count, cfg.train_sample or max(39 * nlist, 39 * 2 ** cfg.pq_nbits))


def _trained_ivf(cfg: BuildConfig, dim: int, count: int, shards: list[np.ndarray]) -> tuple[Any, dict[str, int]]:
    import faiss

    if cfg.index != "ivfsq8" and dim % cfg.pq_m:
        raise ValueError(f"BuildConfig.pq_m: {cfg.pq_m} does not divide the encoder dimension {dim}")
    nlist = cfg.ivf_nlist or max(1, int(4 * math.sqrt(count)))
    n_train = ivf_train_rows(cfg, count, nlist)
    if cfg.index == "opq-ivfpq" and n_train < 256:
        raise ValueError(f"BuildConfig.index: opq-ivfpq trains its rotation with an 8-bit PQ and needs >= 256 "
                         f"training rows; this build has {n_train} (use ivfpq or ivfsq8 for so few passages)")
    rows = np.linspace(0, count - 1, n_train).astype(np.int64)  # evenly spaced: no one corpus region dominates
    train = np.ascontiguousarray(_gather_rows(shards, rows), dtype=np.float32)
    metric = faiss.METRIC_INNER_PRODUCT
    params = {"ivf_nlist": nlist, "train_rows": n_train}
    index: Any
    if cfg.index == "ivfsq8":
        index = faiss.IndexIVFScalarQuantizer(faiss.IndexFlatIP(dim), dim, nlist, faiss.ScalarQuantizer.QT_8bit,
                                              metric)
    elif cfg.index == "ivfpq":
        index = faiss.IndexIVFPQ(faiss.IndexFlatIP(dim), dim, nlist, cfg.pq_m, cfg.pq_nbits, metric)
        params |= {"pq_m": cfg.pq_m, "pq_nbits": cfg.pq_nbits}
    else:  # OPQ learns a rotation that balances variance across the PQ sub-spaces before IVF-PQ
        index = faiss.index_factory(dim, f"OPQ{cfg.pq_m},IVF{nlist},PQ{cfg.pq_m}x{cfg.pq_nbits}", metric)
        params |= {"pq_m": cfg.pq_m, "pq_nbits": cfg.pq_nbits}
    trainer = to_gpu(index) if cfg.faiss_gpu else index
    trainer.train(train)
    if trainer is not index:
        index = faiss.index_gpu_to_cpu(trainer)
    return index, params


def _gather_rows(shards: list[np.ndarray], rows: np.ndarray) -> np.ndarray:
    bounds = np.cumsum([0] + [s.shape[0] for s in shards])
    which = np.searchsorted(bounds, rows, side="right") - 1
    return np.stack([shards[w][r - bounds[w]] for w, r in zip(which, rows, strict=True)])


class ShardVectors:
    """The build's float32 embedding shards, memory-mapped read-only: exact vectors of any rows without holding
    the corpus's embeddings in RAM (the page cache keeps the rows a server touches)."""

    def __init__(self, directory: Path, count: int, dim: int) -> None:
        self.shards: list[np.ndarray] = []
        rows = 0
        while rows < count and shard_path(directory, len(self.shards)).is_file():
            self.shards.append(np.load(shard_path(directory, len(self.shards)), mmap_mode="r"))
            rows += self.shards[-1].shape[0]
        if rows != count or any(s.shape[1] != dim for s in self.shards):
            raise ValueError(f"{directory / SHARD_DIR}: {len(self.shards)} shards hold {rows} rows, the index "
                             f"{count} of dim {dim}: exact re-ranking needs the build's shards")
        self.bounds = np.cumsum([0] + [s.shape[0] for s in self.shards])

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """`[n]` row ids (>= 0) -> `[n, dim]` float32 vectors."""
        which = np.searchsorted(self.bounds, rows, side="right") - 1
        out = np.empty((len(rows), self.shards[0].shape[1]), dtype=np.float32)
        for w in np.unique(which):
            picked = which == w
            out[picked] = self.shards[w][rows[picked] - self.bounds[w]]
        return out

    def rerank(self, queries: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Candidates `rows [n, c]` (-1 = none) rescored by exact inner product with `queries [n, dim]`; the best
        k per query as (scores, rows), each `[n, k]`, -1 / -inf where fewer than k candidates exist."""
        n, c = rows.shape
        valid = rows >= 0
        vectors = np.zeros((n, c, queries.shape[1]), dtype=np.float32)  # [n, c, dim]
        vectors[valid] = self.gather(rows[valid])
        scores = np.einsum("ncd,nd->nc", vectors, queries)
        scores[~valid] = -np.inf
        best = np.argsort(-scores, axis=1, kind="stable")[:, :k]  # [n, k]
        out_rows = np.take_along_axis(rows, best, axis=1)
        out_scores = np.take_along_axis(scores, best, axis=1)
        out_rows[~np.isfinite(out_scores)] = -1
        return out_scores, out_rows


def gpu_count() -> int:
    """GPUs faiss can use: 0 with faiss-cpu (imported lazily, so faiss-gpu is optional)."""
    import faiss

    return int(faiss.get_num_gpus()) if hasattr(faiss, "get_num_gpus") else 0


def to_gpu(index: Any) -> Any:
    """Shard `index` over every GPU faiss sees (each holds 1/n of the rows); error when there are none."""
    import faiss

    if gpu_count() == 0:
        raise ValueError("faiss_gpu requested but faiss sees no GPU (install faiss-gpu and check CUDA)")
    options = faiss.GpuMultipleClonerOptions()
    options.shard = True
    options.useFloat16 = True
    return faiss.index_cpu_to_all_gpus(index, co=options)


def ivf_part(index: Any) -> Any:
    """The IndexIVF inside `index` (itself, or under an OPQ pre-transform), or None for flat / HNSW."""
    import faiss

    try:
        return faiss.extract_index_ivf(index)
    except RuntimeError:
        return None


def load_faiss(directory: Path, *, count: int, dim: int, gpu: bool = False, mmap: bool = False,
               nprobe: int = 32, ef_search: int = 128, path: Path | None = None) -> Any:
    """Read `index.faiss` (or `path`: an imported index's file), check it against the manifest's count and
    dimension, set search-time knobs."""
    import faiss

    path = path or directory / FAISS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"FAISS file {str(path)!r} is missing")
    index: Any = faiss.read_index(str(path), faiss.IO_FLAG_MMAP if mmap else 0)
    if index.ntotal != count or index.d != dim:
        raise ValueError(f"{path}: holds {index.ntotal} vectors of dim {index.d}, "
                         f"manifest says {count} of dim {dim}; the index directory is inconsistent")
    ivf = ivf_part(index)
    if ivf is not None:
        ivf.nprobe = nprobe
    if hasattr(index, "hnsw"):
        index.hnsw.efSearch = ef_search
    return to_gpu(index) if gpu else index
