"""When a weight load may land: between trajectories, between turns, or between decode steps.

`POST /v1/policy` goes through the gate of the batch runner (docs/gateway.md, "Weight loads"):
- `partial=false`: no trajectory starts until the load is done, and the load waits for the running ones, so
  every trajectory is sampled by one policy version (they finish on the weights they started with);
- `partial=true` on an engine with `load_weights_mid_request` (the local engine): the load lands between two
  decode steps at once; running generations continue under the new weights (their tokens record it);
- `partial=true` on any other engine (vLLM, the engine pool): no generation starts until the load is done and
  the load waits for the running generations, so later turns of running trajectories use the new weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Literal

from sisrl.services.engines.base import Engine, Generation, MidRequestLoads, SamplingParams

Granularity = Literal["decode-step", "turn"]


class LoadGate:
    """Counts running trajectories and generations and holds new ones while a load waits for them."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cond = asyncio.Condition()
        self._trajectories = 0  # started and not finished
        self._requests = 0  # generate calls in flight
        self._hold_trajectories = 0  # loads waiting for running trajectories: no new one starts
        self._hold_requests = 0  # loads waiting for running generations: no new one starts

    @property
    def granularity(self) -> Granularity:
        """Where a partial load lands inside a running trajectory."""
        return "decode-step" if isinstance(self.engine, MidRequestLoads) else "turn"

    @asynccontextmanager
    async def trajectory(self) -> AsyncIterator[None]:
        """Hold for one trajectory: starts once no load waits for the running trajectories."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._hold_trajectories)
            self._trajectories += 1
        try:
            yield
        finally:
            async with self._cond:
                self._trajectories -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        """Hold for one generate call: starts once no turn-level load is pending."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._hold_requests)
            self._requests += 1
        try:
            yield
        finally:
            async with self._cond:
                self._requests -= 1
                self._cond.notify_all()

    async def load(self, path: str, version: int, *, partial: bool) -> None:
        """Load `path` as `version` at the point `partial` asks for (module docstring)."""
        engine = self.engine
        if partial and isinstance(engine, MidRequestLoads):
            await engine.load_weights_mid_request(path, version)
        elif partial:
            await self._drained("requests", lambda: engine.load_weights(path, version))
        else:
            await self._drained("trajectories", lambda: engine.load_weights(path, version))

    async def _drained(self, what: Literal["requests", "trajectories"],
                       load: Callable[[], Awaitable[None]]) -> None:
        """Hold new `what`, wait for the running ones to finish, run `load`, release."""
        hold, count = f"_hold_{what}", f"_{what}"
        async with self._cond:
            setattr(self, hold, getattr(self, hold) + 1)
            try:
                await self._cond.wait_for(lambda: getattr(self, count) == 0)
            except BaseException:
                setattr(self, hold, getattr(self, hold) - 1)
                self._cond.notify_all()
                raise
        try:
            await load()
        finally:
            async with self._cond:
                setattr(self, hold, getattr(self, hold) - 1)
                self._cond.notify_all()


class GatedEngine:
    """The engine one trajectory uses: each generate call holds the gate's request slot."""

    def __init__(self, engine: Engine, gate: LoadGate) -> None:
        self.engine = engine
        self.gate = gate

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        async with self.gate.request():
            return await self.engine.generate(prompt_ids, params)

    async def load_weights(self, path: str, version: int) -> None:
        raise RuntimeError("weights are loaded through the gate (LoadGate.load), not through a trajectory's view")

    async def close(self) -> None:
        """The view owns nothing."""
