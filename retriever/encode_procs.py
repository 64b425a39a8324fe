"""Query encoders in worker processes (`serve --encode-processes N`): each process owns one copy of the encoder
with one intra-op thread and encodes the chunks it is sent; FAISS search, the document store and HTTP stay in the
server process.

Why processes: under many one-query clients the server's event loop holds the GIL ~30 % of the time (request
parsing, validation, responses, access log) and encoder threads wait for it between native calls, so the cores
idle while requests queue (a py-spy profile of 200 clients on 2 cores). A process has its own interpreter and
never waits for the loop. Costs: one encoder copy and runtime per process (~0.8 GB each for e5-small on torch
bf16), a few seconds to start them, and pickling the queries in and the [n, dim] vectors out. A worker that dies
breaks the pool: the requests then fail with the error (500) until the server is restarted.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import queue as queue_module
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
from sisrl.retriever.encoder import Encoder, EncoderConfig, load_encoder

logger = logging.getLogger(__name__)

_encoder: Encoder | None = None  # the worker process's own encoder (set by _start_worker)


def _start_worker(cfg: EncoderConfig, threads: int, ready: Any) -> None:
    """Worker initialiser: load the encoder, encode once (first-call costs), then report ready or the error."""
    global _encoder
    try:
        _encoder = load_encoder(cfg, threads=threads)
        _encoder.encode_queries(["warm up"])
    except BaseException as exc:  # reported to the server, which then refuses to start
        ready.put(f"{type(exc).__name__}: {exc}")
        raise
    ready.put("ok")


def _encode(queries: list[str]) -> np.ndarray:
    assert _encoder is not None, "encoder worker used before its initialiser ran"
    return _encoder.encode_queries(queries)


class EncoderProcesses:
    """`processes` spawned workers that each load `cfg` with `threads` intra-op threads; `encode` is awaitable."""

    def __init__(self, cfg: EncoderConfig, processes: int, *, threads: int = 1, start_timeout_s: float = 600.0) -> None:
        if processes < 1:
            raise ValueError(f"encode_processes must be >= 1, got {processes}")
        context = multiprocessing.get_context("spawn")  # never fork a process that holds torch/OpenMP threads
        ready = context.Queue()
        self.processes = processes
        self._pool = ProcessPoolExecutor(processes, mp_context=context, initializer=_start_worker,
                                         initargs=(cfg, threads, ready))
        # A spawn pool starts its processes on the first submission; these also wait for each initialiser.
        warm = [self._pool.submit(_encode, ["warm up"]) for _ in range(processes)]
        try:
            for _ in range(processes):
                status = ready.get(timeout=start_timeout_s)
                if status != "ok":
                    raise RuntimeError(f"an encoder worker process failed to load {cfg.model!r}: {status}")
            for future in warm:
                future.result(timeout=start_timeout_s)
        except queue_module.Empty:
            self.close()
            raise RuntimeError(f"encoder worker processes did not start within {start_timeout_s:.0f} s") from None
        except BaseException:
            self.close()
            raise
        logger.info("%d encoder worker process(es) ready (%s, %d intra-op thread(s) each)", processes, cfg.model,
                    threads)

    async def encode(self, queries: list[str]) -> np.ndarray:
        """[n queries] -> [n, dim] float32 unit vectors, from whichever worker is free."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, _encode, queries)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
