"""Turn-synchronous rollouts, bench/gateway.py's baseline (verl / Search-R1 style): groups of C trajectories
advance turn by turn in lock step (generate all, then search all), and the next group starts when the whole
group has finished. Nothing is stored.

The gateway's agent loop knows nothing of this. Each trajectory gets an engine that waits at its group's
barrier before every generation, so no trajectory starts turn t+1 before every live one of its group has ended
turn t; a trajectory leaves the barrier when it ends. The agent times each engine call around the whole call,
wait included, so here the agent gets a clock of its own and the engine and retriever calls are timed on the
run's clock around the call only; the wait is taken back out of the trajectory's `engine_s`. A trajectory's
time outside engine and retriever calls (total - engine - retriever) thus includes its barrier waits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace

from sisrl.services.agent import Searcher
from sisrl.services.engines.base import Engine, Generation, SamplingParams
from sisrl.services.engines.pool import for_trajectory
from sisrl.services.retrieval_client import Passage
from sisrl.services.runner import BatchRunner, sample_seed
from sisrl.services.schemas import RolloutCreate, Trajectory
from sisrl.services.timing import BusyClock


class TurnBarrier:
    """No party passes `wait` for the n-th time before every party still present has called it n times;
    `leave` takes a party out for good (a finished trajectory no longer holds the others back)."""

    def __init__(self, parties: int) -> None:
        self._parties = parties
        self._arrived = 0
        self._generation = 0
        self._cond = asyncio.Condition()

    async def wait(self) -> None:
        async with self._cond:
            self._arrived += 1
            generation = self._generation
            if self._arrived >= self._parties:
                self._release()
            else:
                await self._cond.wait_for(lambda: self._generation != generation)

    async def leave(self) -> None:
        async with self._cond:
            self._parties -= 1
            if self._arrived and self._arrived >= self._parties:
                self._release()

    def _release(self) -> None:
        self._arrived = 0
        self._generation += 1
        self._cond.notify_all()


class LockStepEngine:
    """One trajectory's engine: waits at `barrier`, then generates on `base` inside `clock`'s engine span.
    `waited_s` sums the waits."""

    def __init__(self, base: Engine, barrier: TurnBarrier, clock: BusyClock) -> None:
        self.base = base
        self.barrier = barrier
        self.clock = clock
        self.waited_s = 0.0

    @property
    def policy_version(self) -> int:
        return self.base.policy_version

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        t0 = time.perf_counter()
        await self.barrier.wait()
        self.waited_s += time.perf_counter() - t0
        with self.clock.span("engine"):
            return await self.base.generate(prompt_ids, params)

    async def load_weights(self, path: str, version: int) -> None:
        await self.base.load_weights(path, version)

    async def close(self) -> None:
        await self.base.close()


class TimedSearcher:
    """`base` inside `clock`'s retriever span (the span the agent opens on its own clock)."""

    def __init__(self, base: Searcher, clock: BusyClock) -> None:
        self.base = base
        self.clock = clock

    async def search(self, query: str) -> list[Passage]:
        with self.clock.span("retriever"):
            return await self.base.search(query)


async def run_turn_synchronous(runner: BatchRunner, request: RolloutCreate, *, concurrency: int,
                               on_done: Callable[[Trajectory], None]) -> None:
    """Roll out every (item, sample) of `request` on `runner`'s engine, retriever and workload, in groups of
    `concurrency` in lock step; `on_done` gets each finished trajectory (batch id "sync")."""
    deps = runner.deps
    pairs = [(i, s) for i in range(len(request.items)) for s in range(request.samples_per_item)]

    async def one(i: int, s: int, barrier: TurnBarrier) -> None:
        item = request.items[i]
        engine = LockStepEngine(for_trajectory(deps.engine), barrier, deps.clock)
        # The same rollout as the gateway's (parameters, limits, agent), on this trajectory's engine.
        alone = BatchRunner(replace(deps, engine=engine, searcher=TimedSearcher(deps.searcher, deps.clock),
                                    clock=BusyClock()), max_concurrency=1)
        try:
            rollout = await alone.rollout(item, request,
                                          seed=sample_seed(request.sampling.seed, i * request.samples_per_item + s))
        finally:
            await barrier.leave()
        if engine.waited_s:  # it generated at least once, so engine_s is there
            rollout.timings["engine_s"] -= engine.waited_s
        on_done(runner.to_trajectory("sync", request, item, s, rollout))

    for first in range(0, len(pairs), concurrency):
        group = pairs[first : first + concurrency]
        barrier = TurnBarrier(len(group))
        await asyncio.gather(*(one(i, s, barrier) for i, s in group))
