"""The asynchronous retrieval path between the HTTP route and the Searcher.

What makes it faster than Search-R1's server for RL traffic, each part switchable (Settings):
- `dedupe`: a GRPO batch repeats each question n times; identical queries are encoded and searched once.
- `cache_size`: an LRU cache of (query, topk) -> hits; later rollouts ask the same first queries again.
- `coalesce_ms`: requests that arrive within a few ms are merged into one encoder batch, so many one-query
  clients (verl, SkyRL send one query per tool call) share a forward pass instead of queueing for it; with
  `coalesce_early` the window closes once as many requests wait as the recent batches held (`_collect`).
- `pipeline_queries`: a coalesced batch is searched in pieces (length-sorted) and each request is answered as
  soon as its piece is done, so responses and new requests flow while the next piece encodes.
- `fifo_window`: the pieces follow the requests' arrival order, length-sorted within windows of a few pieces'
  worth of requests, so under many one-query clients a long query does not go last in every batch.
- `offload`: encoding and search run in worker threads (`encode_workers`), so the event loop keeps accepting
  requests; given `EncoderProcesses`, the encoding runs in worker processes instead (retriever/encode_procs.py).
- `overlap`: the next coalesced batch is collected as soon as a worker has nothing queued, not when the whole
  previous batch is done, so no worker idles while the last chunk of a batch finishes on another.
- Chunks: a piece is spread over the workers in length-balanced chunks (`balanced_chunks`: neighbours in length
  order, cut so that the slowest chunk's padded size is least), since the piece is done when its slowest chunk is;
  where the encoder runs queries unpadded, in chunks of about equal total length instead (`worker_chunks`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from sisrl.retriever.encode_procs import EncoderProcesses
from sisrl.retriever.metrics import Metrics
from sisrl.retriever.searcher import Hit, Searcher

logger = logging.getLogger(__name__)
T = TypeVar("T")
MIN_CHUNK = 4  # queries; smaller pieces are not worth a thread hand-off
# Added to a query's character count in `balanced_chunks`: the query prefix and the two special tokens of an
# E5/BERT-style encoder, which every row pays (e5's WordPiece is ~4 characters a token, so ~4 tokens' worth).
ROW_CHARS = 16
# Characters a query may have per token of the encoder's packing limit and still count as packed: e5/BERT WordPiece
# averages ~4 characters a token on English questions; 3 errs on the side of a chunk that pads after all (slower,
# never wrong).
PACK_CHARS_PER_TOKEN = 3
RECENT_BATCHES = 8  # a coalescing window closes once a batch holds as many requests as the largest of these did


def balanced_chunks(lengths: list[int], groups: int) -> list[list[int]]:
    """Positions of `lengths` cut into at most `groups` chunks, each a run of neighbours in ascending length order,
    so that the largest padded size (a chunk's count x its longest length: what its encoder batch costs when it
    pads to its longest row) is least. Chunks come shortest first; inside one, positions ascend by length.

    Cutting by count instead (the first half of the queries, then the rest) pads every chunk to whatever long
    query it happened to draw, and the slowest chunk decides when the batch is done: with eight one-query clients
    on two workers, a 60-token question padded three 15-token ones beside it. Binary search on that largest size
    with a greedy fill (a run's padded size only grows as it takes its next longer neighbour, so filling each
    chunk as far as the bound allows is optimal): O(n log(n x longest))."""
    if groups < 1:
        raise ValueError(f"groups: expected >= 1, got {groups}")
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    ordered = [lengths[i] for i in order]

    def cut(bound: int) -> list[list[int]] | None:
        chunks: list[list[int]] = []
        start = 0
        while start < len(ordered):
            end = start + 1
            while end < len(ordered) and (end + 1 - start) * ordered[end] <= bound:
                end += 1
            if len(chunks) == groups or (end - start) * ordered[end - 1] > bound:
                return None
            chunks.append(order[start:end])
            start = end
        return chunks

    if not ordered:
        return []
    low, high = max(ordered), len(ordered) * ordered[-1]  # one query alone; everything in one chunk
    while low < high:
        middle = (low + high) // 2
        if cut(middle) is None:
            low = middle + 1
        else:
            high = middle
    chunks = cut(low)
    assert chunks is not None  # `high` always admits a cut
    return chunks


def packed_chunks(lengths: list[int], groups: int) -> list[list[int]]:
    """Positions of `lengths` in at most `groups` chunks of about equal total length: longest first, each to the
    chunk with the least total so far (LPT; within 4/3 of the best, and for a few one-query clients on two workers
    nearly the even split). For an encoder that runs a small chunk as one unpadded row, whose cost is its total."""
    if groups < 1:
        raise ValueError(f"groups: expected >= 1, got {groups}")
    chunks: list[list[int]] = [[] for _ in range(min(groups, len(lengths)))]
    totals = [0] * len(chunks)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        g = min(range(len(chunks)), key=totals.__getitem__)
        chunks[g].append(i)
        totals[g] += lengths[i]
    return chunks


def worker_chunks(lengths: list[int], groups: int, pack_chars: int) -> list[list[int]]:
    """The chunks a piece of queries (`lengths` in characters) goes to the workers in: `balanced_chunks`, or where
    the encoder packs (`pack_chars` > 0: a chunk of one query, or of queries of at most that many characters each,
    runs unpadded and costs its total) `packed_chunks` when its slowest chunk costs less.

    For batches of a few pool questions on two workers, cutting by totals leaves the slowest chunk fewer tokens
    than cutting balanced neighbours does, close to an even split (`bench/chunk_padding.py`; figures:
    docs/results.md)."""
    balanced = balanced_chunks(lengths, groups)
    if pack_chars <= 0:
        return balanced

    def cost(chunk: list[int]) -> int:
        longest = max(lengths[i] for i in chunk)
        return sum(lengths[i] for i in chunk) if len(chunk) == 1 or longest <= pack_chars else len(chunk) * longest

    packed = packed_chunks(lengths, groups)
    return packed if max(map(cost, packed)) < max(map(cost, balanced), default=0) else balanced


@dataclass(frozen=True)
class ServiceOptions:
    dedupe: bool = True
    cache_size: int = 65536
    coalesce_ms: float = 2.0
    coalesce_early: bool = True
    max_batch_queries: int = 1024
    pipeline_queries: int = 64
    offload: bool = True
    max_query_chars: int = 4096
    encode_workers: int = 1
    overlap: bool = True
    fifo_window: int | None = None  # None: 1 where the encoder packs queries, else 2


class LRUCache:
    """(query, topk) -> hits, at most `size` entries; only the event-loop thread touches it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._data: OrderedDict[tuple[str, int], list[Hit]] = OrderedDict()

    def get(self, key: tuple[str, int]) -> list[Hit] | None:
        hits = self._data.get(key)
        if hits is not None:
            self._data.move_to_end(key)
        return hits

    def put(self, key: tuple[str, int], hits: list[Hit]) -> None:
        self._data[key] = hits
        self._data.move_to_end(key)
        while len(self._data) > self.size:
            self._data.popitem(last=False)


@dataclass
class _Pending:
    queries: list[str]
    k: int
    future: asyncio.Future[list[list[Hit]]] = field(repr=False)


class RetrievalService:
    def __init__(self, searcher: Searcher, options: ServiceOptions, metrics: Metrics,
                 processes: EncoderProcesses | None = None) -> None:
        self.searcher, self.options, self.metrics = searcher, options, metrics
        self.processes = processes
        self.cache = LRUCache(options.cache_size) if options.cache_size > 0 else None
        # `encode_workers` threads share the one (read-only) model; a batch is split across them. With one
        # intra-op torch thread each, this uses several cores without OpenMP barriers (see Settings).
        self._executor = ThreadPoolExecutor(max_workers=options.encode_workers, thread_name_prefix="retriever-encode")
        self._queue: asyncio.Queue[_Pending] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._batches: set[asyncio.Task[None]] = set()  # coalesced batches being served (overlap)
        # Encoder chunks submitted and not yet finished; `_free` is set while fewer than the workers.
        self._busy = 0
        self._workers = processes.processes if processes is not None else \
            (options.encode_workers if options.offload else 1)
        self._free = asyncio.Event()
        self._free.set()
        self._recent: deque[int] = deque(maxlen=RECENT_BATCHES)  # requests in each of the last batches
        self._arrivals: asyncio.Event | None = None  # set while `_collect` waits for `_awaited` more requests
        self._awaited = 0
        self._pack_chars = PACK_CHARS_PER_TOKEN * searcher.encoder.pack_tokens
        # Arrival order costs no padding where the encoder packs queries; else windows of two keep most of it.
        self.fifo_window = options.fifo_window if options.fifo_window is not None else \
            (1 if searcher.encoder.pack_tokens else 2)

    async def start(self) -> None:
        if self.options.coalesce_ms > 0:
            self._queue = asyncio.Queue()
            self._worker = asyncio.create_task(self._coalesce_loop(), name="retriever-coalesce")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        for task in list(self._batches):
            task.cancel()
        await asyncio.gather(*self._batches, return_exceptions=True)
        self._executor.shutdown(wait=True)
        if self.processes is not None:
            self.processes.close()

    async def retrieve(self, queries: list[str], k: int) -> list[list[Hit]]:
        """Hits for each query, in order; the same lists a plain `Searcher.search(queries, k)` gives."""
        queries = [q[: self.options.max_query_chars] for q in queries]
        unique = list(dict.fromkeys(queries)) if self.options.dedupe else queries
        self.metrics.duplicates.inc(len(queries) - len(unique))
        found: dict[int, list[Hit]] = {}
        if self.cache is not None:
            for i, query in enumerate(unique):
                hits = self.cache.get((query, k))
                if hits is not None:
                    found[i] = hits
            self.metrics.record_cache(len(found), len(unique) - len(found))
        missing = [i for i in range(len(unique)) if i not in found]
        if missing:
            fresh = await self._search([unique[i] for i in missing], k)
            for i, hits in zip(missing, fresh, strict=True):
                found[i] = hits
                if self.cache is not None:
                    self.cache.put((unique[i], k), hits)
        if not self.options.dedupe:
            return [found[i] for i in range(len(queries))]
        position = {query: i for i, query in enumerate(unique)}
        return [found[position[query]] for query in queries]

    async def _search(self, queries: list[str], k: int) -> list[list[Hit]]:
        if self._queue is None:
            self.metrics.encoder_batch.observe(len(queries))
            return await self._search_parallel(queries, k)
        future: asyncio.Future[list[list[Hit]]] = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(queries, k, future))
        if self._arrivals is not None and self._queue.qsize() >= self._awaited:
            self._arrivals.set()
        return await future

    async def _search_parallel(self, queries: list[str], k: int) -> list[list[Hit]]:
        """Searcher.search over the workers at once, in at most one length-balanced chunk per worker (of at least
        MIN_CHUNK queries where there are enough); hits in the order of `queries`. Inline when not offloaded."""
        groups = max(1, min(self._workers, -(-len(queries) // MIN_CHUNK)))
        chunks = worker_chunks([len(q) + ROW_CHARS for q in queries], groups, self._pack_chars)
        self._busy += len(chunks)  # counted before the first await, so a caller that yields once sees them
        if self._busy >= self._workers:
            self._free.clear()
        parts = await asyncio.gather(*(self._counted(self._search_chunk([queries[i] for i in chunk], k))
                                       for chunk in chunks))
        hits: list[list[Hit]] = [[] for _ in queries]
        for chunk, part in zip(chunks, parts, strict=True):
            for i, found in zip(chunk, part, strict=True):
                hits[i] = found
        return hits

    async def _search_chunk(self, queries: list[str], k: int) -> list[list[Hit]]:
        """Searcher.search on one worker (given encoder processes, one of them encodes and the search runs here)."""
        if self.processes is not None:
            vectors = await self.processes.encode(queries)
            return await self._run(functools.partial(self.searcher.search_vectors, vectors, k))
        return await self._run(functools.partial(self.searcher.search, queries, k))

    async def _counted(self, work: Awaitable[T]) -> T:
        """Await one chunk counted in `_busy`; when it ends (or fails) a worker may be free."""
        try:
            return await work
        finally:
            self._busy -= 1
            if self._busy < self._workers:
                self._free.set()

    async def _run(self, work: Callable[[], T]) -> T:
        if not self.options.offload:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    async def _coalesce_loop(self) -> None:
        """Collect a batch, serve it; with `overlap`, collect the next one once a worker has nothing queued
        (the batches' chunks then queue in order in the executor), else once the batch is done."""
        assert self._queue is not None
        while True:
            if self.options.overlap:
                await self._free.wait()
            batch = await self._collect(self._queue)
            if not self.options.overlap:
                await self._serve_batch_safely(batch)
                continue
            task = asyncio.create_task(self._serve_batch_safely(batch))
            self._batches.add(task)
            task.add_done_callback(self._batches.discard)
            # Two yields: the batch task creates its piece tasks, then each piece counts its chunks in `_busy`
            # (before its first await), so the `_free` check above sees this batch's work.
            await asyncio.sleep(0)
            await asyncio.sleep(0)

    async def _serve_batch_safely(self, batch: list[_Pending]) -> None:
        try:
            await self._serve_batch(batch)
        except Exception as exc:  # hand the error to every waiting request; keep the loop alive
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(exc)

    async def _collect(self, queue: asyncio.Queue[_Pending]) -> list[_Pending]:
        """The first waiting request plus whatever arrives within `coalesce_ms`, up to max_batch_queries; with
        `coalesce_early` the window closes once the batch holds as many requests as the largest of the last
        RECENT_BATCHES did.

        One timer per batch, not one `wait_for` task per request: take what already waits, wait out the rest of
        the window once if there is room, then take what arrived meanwhile. Closing early: closed-loop clients (an
        RL rollout's tool calls) come back in the groups they were answered in, so once the group is in, the rest
        of the window only delays it; a smaller group waits the window out as before, so batches do not split up.
        Under a few one-query clients the window's unused ~2 ms are a few percent of each batch's round trip
        (figures: docs/results.md)."""
        batch = [await queue.get()]
        size = len(batch[0].queries)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.coalesce_ms / 1000
        for last_pass in (False, True):
            while size < self.options.max_batch_queries and not queue.empty():
                pending = queue.get_nowait()
                batch.append(pending)
                size += len(pending.queries)
            remaining = deadline - loop.time()
            if last_pass or size >= self.options.max_batch_queries or remaining <= 0:
                break
            # 0 before the first batch (nothing to expect yet) or with `coalesce_early` off: wait the window out
            expected = max(self._recent, default=0) if self.options.coalesce_early else 0
            if 0 < expected <= len(batch):
                break
            # Woken by the timer at the deadline, or by `_search` once `expected` requests are in.
            self._arrivals = asyncio.Event()
            self._awaited = expected - len(batch) if expected else sys.maxsize
            timer = loop.call_later(remaining, self._arrivals.set)
            try:
                await self._arrivals.wait()
            finally:
                timer.cancel()
                self._arrivals = None
        self._recent.append(len(batch))
        return batch

    def _piece_key(self, unique: list[str], rows: list[list[int]], size: int) -> Callable[[int], tuple[int, int]]:
        """Sort key of the batch's distinct queries before they are cut into pieces of `size`.

        `fifo_window` W > 0: requests in arrival order, in windows of W x `size` queries (a request falls in the
        window where its first new query does), shortest first inside a window; so one large request is
        length-sorted as a whole, and under many one-query clients a request waits mostly for the requests that
        came before it. W = 0: the whole batch shortest first: least padding, but the longest queries of every
        batch go last, miss the next batch and wait about twice as long. W = 1 is fairest; where the encoder pads,
        W = 2 (the default there) keeps most of W = 0's throughput; where it packs, W = 1 costs no padding and is
        the default (figures: docs/results.md)."""
        if self.fifo_window <= 0:
            return lambda i: (0, len(unique[i]))
        window = self.fifo_window * size
        first = [-1] * len(unique)  # the first request that asks query i (rows are in arrival order)
        for j, r in enumerate(rows):
            for i in r:
                if first[i] < 0:
                    first[i] = j
        start: dict[int, int] = {}  # request -> index of its first new query
        for i, j in enumerate(first):
            start.setdefault(j, i)
        return lambda i: (start[first[i]] // window, len(unique[i]))

    async def _serve_batch(self, batch: list[_Pending]) -> None:
        """One encoder batch for all requests, searched at the largest k; each request's lists are cut to its k
        (for exact search the top-k is a prefix of the top-K; HNSW/IVF may differ in rare ties).

        With `pipeline_queries`, the batch's distinct queries go to the workers in pieces of that many, in the
        order of `_piece_key` (length-sorted, so a piece pads to its own longest query; FIFO across requests),
        each piece spread over the workers in length-balanced chunks, all submitted at once so no worker waits
        for the event loop; a request is answered when its last query's piece is done. Without it, when the whole
        batch is: then all its clients reply at once and the encoder idles while the loop reads their next
        requests, so batches come in synchronised waves (as seen under many one-query clients).

        A piece is answered as a whole, not chunk by chunk: under a few one-query clients, answering the chunk of
        short queries first sent those clients' next requests while the other worker still had the long chunk, so
        half of the next batch queued behind it and the p99 latency rose by about a quarter against answering per
        piece."""
        flat = [q for pending in batch for q in pending.queries]
        unique = list(dict.fromkeys(flat)) if self.options.dedupe else flat
        k_max = max(pending.k for pending in batch)
        self.metrics.encoder_batch.observe(len(unique))
        self.metrics.coalesced_requests.observe(len(batch))
        if self.options.dedupe:
            position = {q: i for i, q in enumerate(unique)}
            rows = [[position[q] for q in pending.queries] for pending in batch]
        else:
            starts = [0]
            for pending in batch:
                starts.append(starts[-1] + len(pending.queries))
            rows = [list(range(a, b)) for a, b in zip(starts, starts[1:], strict=False)]
        size = self.options.pipeline_queries
        if size <= 0 or len(unique) <= size:
            pieces = [list(range(len(unique)))]
        else:
            order = sorted(range(len(unique)), key=self._piece_key(unique, rows, size))
            pieces = [order[start:start + size] for start in range(0, len(order), size)]
        waiting = [len(set(r)) for r in rows]  # distinct rows each request still waits for
        requests_of: dict[int, list[int]] = {}
        for j, r in enumerate(rows):
            for i in set(r):
                requests_of.setdefault(i, []).append(j)
        hits: list[list[Hit]] = [[] for _ in unique]
        tasks = [asyncio.ensure_future(self._search_parallel([unique[i] for i in piece], k_max)) for piece in pieces]
        try:
            for piece, task in zip(pieces, tasks, strict=True):
                for i, found in zip(piece, await task, strict=True):
                    hits[i] = found
                    for j in requests_of[i]:
                        waiting[j] -= 1
                        pending = batch[j]
                        if waiting[j] == 0 and not pending.future.done():
                            pending.future.set_result([hits[row][: pending.k] for row in rows[j]])
        finally:
            for task in tasks:
                task.cancel()
