"""Busy-time accounting: how much wall time some engine or retriever call was in flight.

Gateway overhead (bench/gateway.py) = wall time - union of busy intervals. Spans nest and overlap freely;
each category keeps its own union and `any` keeps the union over all categories.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class BusyClock:
    """Union of in-flight intervals per category and overall, in seconds (single event loop, no locks)."""

    def __init__(self) -> None:
        self._active: dict[str, int] = {}
        self._since: dict[str, float] = {}
        self.busy_s: dict[str, float] = {}

    def _enter(self, key: str, now: float) -> None:
        if self._active.get(key, 0) == 0:
            self._since[key] = now
        self._active[key] = self._active.get(key, 0) + 1

    def _exit(self, key: str, now: float) -> None:
        self._active[key] -= 1
        if self._active[key] == 0:
            self.busy_s[key] = self.busy_s.get(key, 0.0) + now - self._since[key]

    @contextmanager
    def span(self, category: str) -> Iterator[None]:
        now = time.perf_counter()
        self._enter(category, now)
        self._enter("any", now)
        try:
            yield
        finally:
            now = time.perf_counter()
            self._exit(category, now)
            self._exit("any", now)
