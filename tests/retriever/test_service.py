"""The fast path (dedupe, LRU cache, coalescing, offload) gives exactly what the plain Searcher gives, and each
switch does what it says, measured on the real MiniLM encoder and FAISS index."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from sisrl.retriever.encode_procs import EncoderProcesses
from sisrl.retriever.metrics import Metrics
from sisrl.retriever.searcher import Searcher, SearcherOptions, encoder_config, open_searcher
from sisrl.retriever.service import (
    RetrievalService,
    ServiceOptions,
    balanced_chunks,
    packed_chunks,
    worker_chunks,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REQUESTS = [
    (["eiffel tower", "coral reef", "eiffel tower"], 3),
    (["jazz music", "coral reef"], 5),
    (["who wrote hamlet"], 1),
    (["eiffel tower"], 3),
    (["chocolate", "chocolate", "chocolate", "rice"], 2),
    (["volcano", "violin", "sushi", "telescope", "marathon", "internet", "rainbow", "coffee", "tsunami"], 4),
]
# float32 whatever `--dtype auto` would pick: the tests compare scores across batch make-ups to 1e-5, and in
# bf16 oneDNN's AMX kernels round differently by batch shape (seen: 1.3e-3 on an Intel Xeon with amx_bf16).
FP32 = SearcherOptions(encoder="minilm", dtype="float32")
ALL_OFF = ServiceOptions(dedupe=False, cache_size=0, coalesce_ms=0, offload=False)
ALL_ON = ServiceOptions(dedupe=True, cache_size=128, coalesce_ms=20, offload=True, encode_workers=2)


@pytest.fixture(scope="module")
def searcher(minilm_index: Path) -> Iterator[Searcher]:
    searcher = open_searcher(minilm_index, FP32)
    yield searcher
    searcher.close()


def _run(searcher: Searcher, options: ServiceOptions, requests: list[tuple[list[str], int]],
         metrics: Metrics | None = None, processes: EncoderProcesses | None = None) -> list[list[list[tuple[str, float]]]]:
    async def main() -> list[list[list[tuple[str, float]]]]:
        service = RetrievalService(searcher, options, metrics or Metrics(), processes)
        await service.start()
        try:
            results = await asyncio.gather(*(service.retrieve(q, k) for q, k in requests))
        finally:
            await service.stop()
        return [[[(p.id, s) for p, s in hits] for hits in result] for result in results]
    return asyncio.run(main())


def _expected(searcher: Searcher) -> list[list[list[tuple[str, float]]]]:
    return [[[(p.id, s) for p, s in hits] for hits in searcher.search(q, k)] for q, k in REQUESTS]


def _assert_same(got: list[list[list[tuple[str, float]]]], want: list[list[list[tuple[str, float]]]]) -> None:
    assert [[[i for i, _ in row] for row in r] for r in got] == [[[i for i, _ in row] for row in r] for r in want]
    flat_got = [s for r in got for row in r for _, s in row]
    flat_want = [s for r in want for row in r for _, s in row]
    np.testing.assert_allclose(flat_got, flat_want, atol=1e-5)  # batch make-up may move the last float bits


@pytest.mark.parametrize("options", [ALL_OFF, ALL_ON, ServiceOptions(dedupe=True, cache_size=0, coalesce_ms=0),
                                     ServiceOptions(dedupe=False, cache_size=16, coalesce_ms=5, offload=False),
                                     ServiceOptions(dedupe=False, cache_size=0, coalesce_ms=0, encode_workers=3),
                                     ServiceOptions(cache_size=0, coalesce_ms=50, pipeline_queries=2, encode_workers=2),
                                     ServiceOptions(dedupe=False, cache_size=0, coalesce_ms=50, pipeline_queries=3)],
                         ids=["all-off", "all-on", "dedupe-only", "cache+coalesce-inline", "3-workers",
                              "pipelined-pieces-of-2", "pipelined-no-dedupe"])
def test_every_switch_setting_gives_the_plain_search_results(searcher: Searcher, options: ServiceOptions) -> None:
    _assert_same(_run(searcher, options, REQUESTS), _expected(searcher))


def _sample(metrics: Metrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    return 0.0 if value is None else float(value)


def test_coalescing_merges_concurrent_requests_into_one_encoder_batch(searcher: Searcher) -> None:
    metrics = Metrics()
    singles = [([f"question number {i} about volcanoes"], 3) for i in range(8)]
    _run(searcher, ServiceOptions(coalesce_ms=50, cache_size=0), singles, metrics)
    assert _sample(metrics, "sisrl_retriever_encoder_batch_queries_count") == 1
    assert _sample(metrics, "sisrl_retriever_encoder_batch_queries_sum") == 8
    assert _sample(metrics, "sisrl_retriever_coalesced_requests_sum") == 8


def test_without_coalescing_each_request_is_its_own_batch(searcher: Searcher) -> None:
    metrics = Metrics()
    _run(searcher, ServiceOptions(coalesce_ms=0, cache_size=0), [([f"q {i}"], 3) for i in range(4)], metrics)
    assert _sample(metrics, "sisrl_retriever_encoder_batch_queries_count") == 4


@pytest.mark.parametrize(("dedupe", "encoded"), [(True, 2), (False, 10)])
def test_dedupe_encodes_each_distinct_query_once(searcher: Searcher, dedupe: bool, encoded: int) -> None:
    metrics = Metrics()
    rl_batch = [(["capital of france", "tallest mountain"] * 5, 3)]  # GRPO: each question n times
    result = _run(searcher, ServiceOptions(dedupe=dedupe, cache_size=0, coalesce_ms=0), rl_batch, metrics)
    assert _sample(metrics, "sisrl_retriever_encoder_batch_queries_sum") == encoded
    assert result[0][0] == result[0][2] == result[0][8]


def test_cache_answers_repeats_without_the_encoder(searcher: Searcher) -> None:
    metrics = Metrics()

    async def main() -> None:
        service = RetrievalService(searcher, ServiceOptions(cache_size=2, coalesce_ms=0), metrics)
        await service.start()
        first = await service.retrieve(["sushi", "kangaroo"], 3)
        again = await service.retrieve(["kangaroo", "sushi"], 3)
        assert again == first[::-1]
        assert _sample(metrics, "sisrl_retriever_encoder_batch_queries_count") == 1
        await service.retrieve(["sushi"], 4)  # another topk is another entry, and evicts the oldest
        await service.retrieve(["kangaroo"], 3)
        await service.stop()

    asyncio.run(main())
    assert _sample(metrics, "sisrl_retriever_cache_hits_total") == 2
    assert _sample(metrics, "sisrl_retriever_cache_misses_total") == 4
    assert _sample(metrics, "sisrl_retriever_encoder_batch_queries_count") == 3
    assert _sample(metrics, "sisrl_retriever_cache_hit_rate") == pytest.approx(2 / 6)


def _padded(lengths: list[int], chunks: list[list[int]]) -> int:
    """The largest padded size of a cut: a chunk's count x its longest length."""
    return max(len(chunk) * max(lengths[i] for i in chunk) for chunk in chunks)


def test_balanced_chunks_cut_length_sorted_neighbours_with_the_least_largest_padded_size() -> None:
    # Hand-derived: sorted 12 14 15 17 19 22 30 45; halves by count pad to 4 x 45 = 180 (or 4 x 17 = 68 and
    # 4 x 45 = 180 when sorted); six and two give max(6 x 22, 2 x 45) = 132, five and three max(95, 135).
    lengths = [45, 14, 17, 12, 30, 15, 22, 19]
    chunks = balanced_chunks(lengths, 2)
    assert [[lengths[i] for i in chunk] for chunk in chunks] == [[12, 14, 15, 17, 19, 22], [30, 45]]
    assert _padded(lengths, chunks) == 132
    assert balanced_chunks([7], 3) == [[0]] and balanced_chunks([], 2) == []
    assert balanced_chunks([3, 3, 3, 3], 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="groups: expected >= 1, got 0"):
        balanced_chunks([1, 2], 0)


@pytest.mark.parametrize("seed", range(20))
def test_balanced_chunks_equal_the_best_cut_found_by_trying_every_one(seed: int) -> None:
    import itertools
    import random

    rng = random.Random(seed)
    lengths = [rng.randint(5, 80) for _ in range(rng.randint(1, 9))]
    groups = rng.randint(1, 4)
    chunks = balanced_chunks(lengths, groups)
    assert sorted(i for chunk in chunks for i in chunk) == list(range(len(lengths)))  # every position once
    assert 1 <= len(chunks) <= groups
    ordered = sorted(range(len(lengths)), key=lengths.__getitem__)
    best = min(_padded(lengths, [ordered[a:b] for a, b in zip((0, *cuts), (*cuts, len(lengths)), strict=True)])
               for n in range(min(groups, len(lengths)))
               for cuts in itertools.combinations(range(1, len(lengths)), n))
    assert _padded(lengths, chunks) == best


def test_packed_chunks_even_out_the_totals_longest_first() -> None:
    # 40 -> A, 40 -> B, then the four 10s alternate: 60 and 60 (neighbours in length order give 40 and 80)
    lengths = [10, 40, 10, 10, 40, 10]
    chunks = packed_chunks(lengths, 2)
    assert sorted(sum(lengths[i] for i in chunk) for chunk in chunks) == [60, 60]
    assert sorted(i for chunk in chunks for i in chunk) == list(range(6))
    assert packed_chunks([5, 7], 4) == [[1], [0]] and packed_chunks([], 2) == []
    with pytest.raises(ValueError, match="groups: expected >= 1, got 0"):
        packed_chunks([1, 2], 0)


def test_worker_chunks_cut_by_totals_only_where_the_chunks_run_packed() -> None:
    lengths = [10, 40, 10, 10, 40, 10]
    neighbours = balanced_chunks(lengths, 2)  # four 10s (padded 40) and two 40s (padded 80)
    assert sorted(sorted(lengths[i] for i in chunk) for chunk in neighbours) == [[10, 10, 10, 10], [40, 40]]
    assert worker_chunks(lengths, 2, pack_chars=0) == neighbours  # the encoder pads every call
    by_totals = worker_chunks(lengths, 2, pack_chars=50)  # all packed: 60 and 60 against 40 and 80
    assert sorted(sum(lengths[i] for i in chunk) for chunk in by_totals) == [60, 60]
    # queries over 30 characters pad: 40, 10, 10 would cost 3 x 40 = 120, more than the neighbours' 80
    assert worker_chunks(lengths, 2, pack_chars=30) == neighbours


def test_a_packing_encoder_gets_chunks_of_about_equal_total_length(minilm_index: Path) -> None:
    """Six one-query requests, two of them long, two workers, the traced torch MiniLM (which runs a small chunk as
    one unpadded row): each worker gets one long query and two short ones, not the four short ones in one chunk
    and both long ones in the other (what neighbours in length order give)."""
    searcher = open_searcher(minilm_index, replace(FP32, backend="torch"))
    assert searcher.encoder.pack_tokens > 0
    long_queries = ["who painted the ceiling of the sistine chapel in rome", "what is the tallest mountain in the solar system"]
    short = ["rice", "salt", "jazz", "tea"]
    recorder = _SizeRecorder(searcher)

    async def main() -> None:
        service = RetrievalService(recorder, ServiceOptions(cache_size=0, coalesce_ms=50,  # type: ignore[arg-type]
                                                            encode_workers=2), Metrics())
        await service.start()
        try:
            await asyncio.gather(*(service.retrieve([q], 3) for q in [*short[:2], *long_queries, *short[2:]]))
        finally:
            await service.stop()

    try:
        asyncio.run(main())
    finally:
        searcher.close()
    assert len(recorder.calls) == 2
    assert sorted(len(set(call) & set(long_queries)) for call in recorder.calls) == [1, 1], recorder.calls


def test_the_fifo_window_defaults_to_arrival_order_where_the_encoder_packs(minilm_index: Path) -> None:
    """Where the encoder packs queries, their order costs no padding: pieces follow arrival order (window 1);
    where it pads, windows of two keep most of the length sorting; a window given is kept either way."""
    packing = open_searcher(minilm_index, replace(FP32, backend="torch"))
    padding = open_searcher(minilm_index, replace(FP32, backend="torch", pack=False))
    try:
        assert packing.encoder.pack_tokens > 0 and padding.encoder.pack_tokens == 0
        assert RetrievalService(packing, ServiceOptions(), Metrics()).fifo_window == 1
        assert RetrievalService(padding, ServiceOptions(), Metrics()).fifo_window == 2
        assert RetrievalService(packing, ServiceOptions(fifo_window=2), Metrics()).fifo_window == 2
    finally:
        packing.close()
        padding.close()


class _SizeRecorder:
    """The real searcher, recording the queries of each call (one per chunk a worker runs)."""

    def __init__(self, searcher: Searcher) -> None:
        self.searcher, self.calls = searcher, []  # type: ignore[var-annotated]
        self.manifest, self.encoder = searcher.manifest, searcher.encoder
        self.lock = threading.Lock()

    def search(self, queries: list[str], k: int) -> list[list[tuple[object, float]]]:
        with self.lock:
            self.calls.append(list(queries))
        return self.searcher.search(queries, k)  # type: ignore[return-value]


def test_a_coalesced_batch_goes_to_the_workers_in_length_balanced_chunks(searcher: Searcher) -> None:
    """Eight one-query requests, one of them long, two workers: the long query gets a chunk of its own and the
    seven short ones share the other, instead of four and four (where three short ones pad to the long one)."""
    long_query = "which nineteenth-century naturalist wrote a book about the formation of vegetable mould " * 2
    short = ["rice", "salt", "jazz", "tea", "coral", "violin", "sushi"]
    recorder = _SizeRecorder(searcher)

    async def main() -> list[list[list[tuple[object, float]]]]:
        service = RetrievalService(recorder, ServiceOptions(cache_size=0, coalesce_ms=50,  # type: ignore[arg-type]
                                                            encode_workers=2), Metrics())
        await service.start()
        try:
            return await asyncio.gather(*(service.retrieve([q], 3) for q in [short[0], long_query, *short[1:]]))
        finally:
            await service.stop()

    results = asyncio.run(main())
    assert sorted(map(sorted, recorder.calls)) == [sorted(short), [long_query]]
    for query, hits in zip([short[0], long_query, *short[1:]], results, strict=True):
        assert [p.id for p, _ in hits[0]] == [p.id for p, _ in searcher.search([query], 3)[0]]


@pytest.mark.parametrize("early", [True, False])
def test_the_window_closes_once_as_many_requests_wait_as_recent_batches_held(searcher: Searcher, early: bool) -> None:
    """Closed-loop clients come back in the groups they were answered in: with a 400 ms window, a first round of
    three requests waits the whole window (nothing to expect yet), a second round of three is sent on as soon as
    all three are in, and a round of two still waits the window out for a third. Each round is one batch. With
    `coalesce_early` off every round waits the whole window."""
    window_s = 0.4
    metrics = Metrics()

    async def main() -> list[float]:
        service = RetrievalService(searcher, ServiceOptions(cache_size=0, coalesce_ms=window_s * 1000,
                                                            coalesce_early=early, encode_workers=2), metrics)
        await service.start()
        took = []
        try:
            for round_ in (["rice", "salt", "jazz"], ["tea", "coral", "violin"], ["sushi", "marathon"]):
                began = time.perf_counter()
                await asyncio.gather(*(service.retrieve([q], 3) for q in round_))
                took.append(time.perf_counter() - began)
        finally:
            await service.stop()
        return took

    first, second, third = asyncio.run(main())
    assert first >= window_s and third >= window_s
    if early:
        assert second < window_s / 2  # three short queries encode in milliseconds
    else:
        assert second >= window_s
    samples = {s.name: s.value for m in metrics.coalesced_requests.collect() for s in m.samples}
    assert samples["sisrl_retriever_coalesced_requests_count"] == 3  # batches
    assert samples["sisrl_retriever_coalesced_requests_sum"] == 8  # requests in them


class _LoopProbe:
    """The searcher, but `search` first waits (up to `wait_s`) for the event loop to answer: it can only answer
    while the search runs if the search is not blocking the loop's thread. No timing ratio is involved."""

    def __init__(self, searcher: Searcher, wait_s: float) -> None:
        self.searcher, self.wait_s = searcher, wait_s
        self.started, self.loop_answered = threading.Event(), threading.Event()
        self.thread: int | None = None
        self.answered_during_search = False

    def search(self, queries: list[str], k: int) -> object:
        self.thread = threading.get_ident()
        self.started.set()
        self.answered_during_search = self.loop_answered.wait(self.wait_s)
        return self.searcher.search(queries, k)

    def __getattr__(self, name: str) -> object:
        return getattr(self.searcher, name)


@pytest.mark.parametrize("offload", [True, False])
def test_offload_keeps_the_event_loop_free(searcher: Searcher, offload: bool) -> None:
    # Offloaded, the loop answers at once (the 60 s only bound a broken run); inline, it cannot answer before
    # the wait ends, however long that is, so a short wait keeps the test cheap.
    probe = _LoopProbe(searcher, wait_s=60.0 if offload else 0.5)

    async def main() -> int:
        service = RetrievalService(probe, ServiceOptions(offload=offload, coalesce_ms=0, cache_size=0),  # type: ignore[arg-type]
                                   Metrics())
        await service.start()

        async def answer() -> None:
            while not probe.started.is_set():
                await asyncio.sleep(0.001)
            probe.loop_answered.set()

        task = asyncio.create_task(answer())
        await service.retrieve(["long question about the history of printing"], 3)
        await service.stop()
        await task
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert probe.answered_during_search is offload
    assert (probe.thread != loop_thread) is offload  # offloaded: the search ran in a worker thread


class _CountingSearcher:
    """The real searcher, counting its finished calls (one per piece of a coalesced batch)."""

    def __init__(self, searcher: Searcher) -> None:
        self.searcher, self.calls = searcher, 0
        self.manifest, self.encoder = searcher.manifest, searcher.encoder

    def search(self, queries: list[str], k: int) -> list[list[tuple[object, float]]]:
        hits = self.searcher.search(queries, k)
        self.calls += 1  # one worker thread: no lost update
        return hits  # type: ignore[return-value]


@pytest.mark.parametrize("pipeline", [4, 0])
def test_a_pipelined_batch_answers_each_request_when_its_piece_is_done(searcher: Searcher, pipeline: int) -> None:
    counting = _CountingSearcher(searcher)
    long_request = [f"a much longer question number {i} about the history of volcanoes" for i in range(40)]
    calls_when_answered: dict[str, int] = {}

    async def ask(service: RetrievalService, name: str, queries: list[str]) -> None:
        await service.retrieve(queries, 3)
        calls_when_answered[name] = counting.calls

    async def main() -> None:
        service = RetrievalService(counting, ServiceOptions(cache_size=0, coalesce_ms=50,  # type: ignore[arg-type]
                                                            pipeline_queries=pipeline, encode_workers=1), Metrics())
        await service.start()
        try:
            await asyncio.gather(ask(service, "short", ["rice"]), ask(service, "long", long_request))
        finally:
            await service.stop()

    asyncio.run(main())
    if pipeline:  # 41 distinct queries in pieces of 4, shortest first: "rice" is in the first of eleven
        assert counting.calls == 11
        assert calls_when_answered["long"] == 11
        # answered once the first piece is done; the worker goes on with the next pieces meanwhile, so by the time
        # the event loop resumes the caller one or two more may have finished, never most of them
        assert calls_when_answered["short"] <= 5
    else:  # one call for the whole batch; both answered after it
        assert counting.calls == 1
        assert calls_when_answered == {"short": 1, "long": 1}


@pytest.mark.parametrize("window", [1, 2, 0])
def test_fifo_pieces_answer_earlier_requests_first_whatever_their_length(searcher: Searcher, window: int) -> None:
    """Eight one-query requests in one coalesced batch, pieces of 2: the four that arrive first have long
    queries, the four after them short ones. In FIFO windows of 1 or 2 pieces the long ones are answered first
    (each window length-sorted); with `fifo_window=0` the whole batch is shortest first, so the late short ones
    go first."""
    long_queries = [f"a much longer question number {i} about the history of volcanoes and their eruptions"
                    for i in range(4)]
    short_queries = ["rice", "salt", "jazz", "tea"]
    answered: list[str] = []

    async def ask(service: RetrievalService, query: str) -> list[list[tuple[object, float]]]:
        hits = await service.retrieve([query], 3)
        answered.append(query)
        return hits  # type: ignore[return-value]

    async def main() -> list[list[list[tuple[object, float]]]]:
        service = RetrievalService(searcher, ServiceOptions(cache_size=0, coalesce_ms=50, pipeline_queries=2,
                                                            encode_workers=1, fifo_window=window), Metrics())
        await service.start()
        try:
            return await asyncio.gather(*(ask(service, q) for q in long_queries + short_queries))
        finally:
            await service.stop()

    results = asyncio.run(main())
    first_four = set(answered[:4])
    assert first_four == (set(long_queries) if window else set(short_queries)), answered
    for query, hits in zip(long_queries + short_queries, results, strict=True):  # same hits either way
        assert [p.id for p, _ in hits[0]] == [p.id for p, _ in searcher.search([query], 3)[0]]


def test_encode_plan_is_one_single_threaded_worker_per_core_on_a_cpu() -> None:
    import os

    from sisrl.retriever.app import encode_plan
    from sisrl.retriever.settings import Settings

    cores = len(os.sched_getaffinity(0))
    index = Path("unused-index")
    assert encode_plan(Settings(index=index)) == (cores, 1 if cores > 1 else 0)
    assert encode_plan(Settings(index=index, encode_workers=1)) == (1, 0)  # one worker: the runtime's own team
    assert encode_plan(Settings(index=index, encode_workers=3)) == (3, 1)
    assert encode_plan(Settings(index=index, torch_threads=2)) == (cores, 2)
    assert encode_plan(Settings(index=index, device="cuda")) == (1, 0)
    assert encode_plan(Settings(index=index, faiss_gpu=True, encode_workers=2, torch_threads=4)) == (2, 4)


def test_encoder_processes_give_the_plain_searchers_results(searcher: Searcher,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # Two real worker processes, each with its own copy of the index's encoder (spawned, model loaded there);
    # search stays in this process. Coalesced, pipelined in pieces of 3, deduplicated: the same hits and scores,
    # and this process's encoder is never asked.
    want = _expected(searcher)
    cfg = encoder_config(searcher.manifest, FP32)
    processes = EncoderProcesses(cfg, 2, threads=1)  # closed by the service's stop()

    def not_here(texts: list[str]) -> None:
        raise AssertionError(f"encoded in the server process: {texts[:2]}")

    monkeypatch.setattr(searcher.encoder, "encode_queries", not_here)
    got = _run(searcher, ServiceOptions(cache_size=0, coalesce_ms=20, pipeline_queries=3, encode_workers=1),
               REQUESTS, processes=processes)
    _assert_same(got, want)


def test_an_encoder_process_that_cannot_load_its_model_stops_the_start_naming_it(searcher: Searcher,
                                                                                   tmp_path: Path) -> None:
    cfg = encoder_config(searcher.manifest, FP32)
    broken = replace(cfg, model=str(tmp_path / "no-such-model"))
    with pytest.raises(RuntimeError, match="failed to load .*no-such-model"):
        EncoderProcesses(broken, 1, start_timeout_s=120)


class _GatedSearcher:
    """The real searcher, except that a call containing "slow" waits for `release` (set by the test)."""

    def __init__(self, searcher: Searcher) -> None:
        self.searcher, self.release = searcher, threading.Event()
        self.manifest, self.encoder = searcher.manifest, searcher.encoder

    def search(self, queries: list[str], k: int) -> list[list[tuple[object, float]]]:
        if "slow" in queries:
            assert self.release.wait(timeout=30), "the test never released the slow call"
        return self.searcher.search(queries, k)  # type: ignore[return-value]


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_serves_the_next_batch_while_a_worker_still_runs_the_last(searcher: Searcher, overlap: bool) -> None:
    """Two workers; batch 1 is one chunk ("slow", held). With overlap the free worker takes batch 2 ("fast") at
    once; without it, batch 2 is collected only after batch 1 is done."""
    gated = _GatedSearcher(searcher)

    async def main() -> tuple[bool, list[list[tuple[object, float]]]]:
        service = RetrievalService(gated, ServiceOptions(cache_size=0, coalesce_ms=1, encode_workers=2,  # type: ignore[arg-type]
                                                         overlap=overlap), Metrics())
        await service.start()
        try:
            slow = asyncio.ensure_future(service.retrieve(["slow"], 3))
            await asyncio.sleep(0.2)  # batch 1 collected and running
            fast = asyncio.ensure_future(service.retrieve(["fast"], 3))
            done, _ = await asyncio.wait([fast], timeout=3)
            fast_before_slow = fast in done and not slow.done()
            gated.release.set()
            await asyncio.gather(slow, fast)
            return fast_before_slow, fast.result()[0]
        finally:
            gated.release.set()
            await service.stop()

    fast_before_slow, hits = asyncio.run(main())
    assert fast_before_slow is overlap
    assert [p.id for p, _ in hits] == [p.id for p, _ in searcher.search(["fast"], 3)[0]]
