"""The synchronous core of retrieval: encode queries, search FAISS, read the passages. No caching here."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sisrl.retriever.corpus import Passage
from sisrl.retriever.docstore import DocStore
from sisrl.retriever.encoder import Encoder, EncoderConfig, load_encoder
from sisrl.retriever.index import ShardVectors, load_faiss
from sisrl.retriever.manifest import Manifest, ManifestError, identity_mismatch, load_manifest
from sisrl.retriever.prebuilt import check_files

logger = logging.getLogger(__name__)

Hit = tuple[Passage, float]


@dataclass(frozen=True)
class SearcherOptions:
    encoder: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    backend: str = "auto"
    threads: int = 0  # intra-op threads of the encoder; 0 = one per core
    encode_batch_size: int = 64
    trace: bool = True  # torch on a CPU: the traced forward (retriever/traced.py)
    pack: bool = True  # and its packed calls of short texts
    faiss_gpu: bool = False
    mmap_index: bool = False
    nprobe: int = 32
    ef_search: int = 128
    rerank: int = 0  # approximate indexes: candidates per query re-scored exactly from the float shards; 0 = off


class Searcher:
    """Encoder + FAISS index + document store of one index directory, checked against each other."""

    def __init__(self, manifest: Manifest, encoder: Encoder, index: Any, store: DocStore,
                 exact: ShardVectors | None = None, rerank: int = 0) -> None:
        self.manifest, self.encoder, self.index, self.store = manifest, encoder, index, store
        self.exact, self.rerank = exact, rerank

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        """`[n queries]` -> n lists of k (passage, score), best first. Rows FAISS could not fill are dropped."""
        if not queries:
            return []
        return self.search_vectors(self.encoder.encode_queries(queries), k)  # [n, dim] float32, unit norm

    def search_vectors(self, vectors: np.ndarray, k: int) -> list[list[Hit]]:
        """`search` for queries already encoded by this index's encoder: `[n, dim]` unit vectors."""
        if len(vectors) == 0:
            return []
        if self.exact is not None and self.rerank > k:
            _, candidates = self.index.search(vectors, self.rerank)  # [n, rerank] approximate
            scores, rows = self.exact.rerank(vectors, candidates, k)  # [n, k] exact inner products
        else:
            scores, rows = self.index.search(vectors, k)  # [n, k] each
        return [self._hits(row_ids, row_scores) for row_ids, row_scores in zip(rows, scores, strict=True)]

    def _hits(self, rows: np.ndarray, scores: np.ndarray) -> list[Hit]:
        return [(self.store.get(int(r)), float(s)) for r, s in zip(rows, scores, strict=True) if r >= 0]

    def close(self) -> None:
        self.store.close()


def encoder_config(manifest: Manifest, options: SearcherOptions) -> EncoderConfig:
    """The EncoderConfig that reproduces the manifest's encoder, with the serving dtype/device/batch."""
    spec = manifest.encoder
    return EncoderConfig(model=options.encoder or spec.model, query_prefix=spec.query_prefix,
                         passage_prefix=spec.passage_prefix, max_length=spec.max_length, dtype=options.dtype,
                         device=options.device, batch_size=options.encode_batch_size, backend=options.backend,
                         trace=options.trace, pack=options.pack)


def check_encoder(manifest: Manifest, encoder: Encoder, directory: Path) -> None:
    """Raise ManifestError when `encoder` would not make the vectors the index was built with."""
    if encoder.dim != manifest.dim:
        raise ManifestError(f"encoder {encoder.cfg.model!r} makes {encoder.dim}-dim vectors but the index at "
                            f"{directory} holds {manifest.dim}-dim ones (built with {manifest.encoder.model!r})")
    differences = identity_mismatch(manifest.encoder_identity, encoder.identity)
    if differences:
        raise ManifestError(f"encoder {encoder.cfg.model!r} does not match the index at {directory} "
                            f"(built with {manifest.encoder.model!r}): " + "; ".join(differences))


def open_searcher(directory: Path, options: SearcherOptions | None = None) -> Searcher:
    """Load and cross-check manifest, encoder, FAISS file and document store; fail fast with the reason."""
    options = options or SearcherOptions()
    started = time.perf_counter()
    manifest = load_manifest(directory)
    check_files(manifest, directory)  # an imported index's files live elsewhere: are they still there?
    if options.encoder is not None and options.encoder != manifest.encoder.model:
        # The model is part of the identity: a different one cannot match, so say so before loading it.
        raise ManifestError(f"encoder {options.encoder!r} does not match the index at {directory} (built with "
                            f"{manifest.encoder.model!r}): " + "; ".join(identity_mismatch(
                                {"model": manifest.encoder.model}, {"model": options.encoder})))
    # The encoder is checked before the (possibly tens of GB) FAISS file is read: a mismatch fails in seconds.
    encoder = load_encoder(encoder_config(manifest, options), threads=options.threads)
    check_encoder(manifest, encoder, directory)
    store = DocStore(directory, docs=manifest.path(directory, "docs"))
    try:
        if len(store) != manifest.count:
            raise ManifestError(f"{directory}: document store has {len(store)} passages, manifest says {manifest.count}")
        index = load_faiss(directory, count=manifest.count, dim=manifest.dim, gpu=options.faiss_gpu,
                           mmap=options.mmap_index, nprobe=options.nprobe, ef_search=options.ef_search,
                           path=manifest.path(directory, "faiss"))
        # A flat index is exact already: re-ranking it would only cost time.
        exact = ShardVectors(directory, manifest.count, manifest.dim) \
            if options.rerank and manifest.index_type != "flat" else None
    except BaseException:
        store.close()
        raise
    logger.info("index %s opened in %.2fs: %d passages, %s", directory, time.perf_counter() - started,
                manifest.count, manifest.index_type)
    return Searcher(manifest, encoder, index, store, exact, options.rerank)


__all__ = ["Hit", "Searcher", "SearcherOptions", "open_searcher", "encoder_config", "check_encoder"]
