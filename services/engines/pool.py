"""Several engine servers behind one gateway: least-loaded, sticky per trajectory, failover, per-server versions.

Routing: a trajectory takes the usable server with the fewest requests in flight (ties: the one that has served
fewest trajectories) for its first turn and keeps it for every later turn, so the server's prefix cache holds the
trajectory's context (verl's async server manager routes the same way). Usable means up, not loading weights and
holding the pool's current policy version.

Failure: a generation that fails on a server (transport error, timeout, 5xx after that engine's own retries) marks
the server down for `down_s` (doubled up to 8x while it keeps failing) and the same turn is sent to another
server from its start: a turn is one request, so nothing of it was recorded. A request a server refuses (4xx,
`ValueError`) is not retried elsewhere: every server would refuse it. A down server is probed (`GET /health`)
once its time is up; it rejoins when that answers and, if the pool has loaded weights since it went down, after it
has loaded them again (a server that restarted serves its start-up weights).

Weights: `load_weights` drains each server (no new turns, in-flight ones finish with the version they started
on), loads it, and gives it the new version; servers load concurrently. A server that fails to load stays out of
rotation (down, stale) until a later probe reloads it with the current version. Every generation carries the
version of the server that produced it, never a version that server did not have. The pool's version moves on
once at least one server has the new weights; when none has, `load_weights` raises and nothing moves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import httpx
from sisrl.services.engines.base import Engine, Generation, SamplingParams
from sisrl.services.outage import mark_down

log = logging.getLogger(__name__)


class ServerEngine(Engine, Protocol):
    """An engine that talks to one server at `url` (VLLMHttpEngine)."""

    url: str


@dataclass
class Server:
    """One engine server of the pool and its counters (read by the gateway's /metrics)."""

    engine: ServerEngine
    in_flight: int = 0
    failures: int = 0  # > 0: down
    down_until: float = 0.0  # time.monotonic() when a probe may bring it back
    stale: bool = False  # must load the pool's current weights before it serves again
    loading: bool = False
    last_error: str = ""
    trajectories: int = 0
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    busy_s: float = 0.0  # wall time with at least one request in flight
    _busy_since: float = 0.0
    probe: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return self.engine.url

    @property
    def up(self) -> bool:
        return self.failures == 0 and not self.stale

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @property
    def tokens_per_s(self) -> float:
        busy = self.busy_s + (time.monotonic() - self._busy_since if self.in_flight else 0.0)
        return self.tokens / busy if busy > 0 else 0.0


class EnginePool:
    """`Engine` over several servers (see the module docstring). Use `for_trajectory()` per trajectory."""

    def __init__(self, engines: Sequence[ServerEngine], *, down_s: float = 5.0, probe_timeout_s: float = 5.0,
                 wait_s: float = 60.0) -> None:
        """`down_s`: first time out after a failure; `wait_s`: the longest a turn waits for a usable server
        while others are down or loading before it fails naming each server's last error."""
        if not engines:
            raise ValueError("an engine pool needs at least one engine server, got none")
        urls = [e.url for e in engines]
        if len(set(urls)) != len(urls):
            raise ValueError(f"engine server URLs must be distinct, got {urls}")
        versions = {e.policy_version for e in engines}
        if len(versions) != 1:
            raise ValueError(f"engine servers start at different policy versions: {sorted(versions)}")
        if down_s <= 0 or wait_s <= 0:
            raise ValueError(f"down_s and wait_s must be > 0, got {down_s} and {wait_s}")
        self.servers = [Server(engine) for engine in engines]
        self.policy_version = versions.pop()
        self.down_s = down_s
        self.probe_timeout_s = probe_timeout_s
        self.wait_s = wait_s
        self._weights: tuple[str, int] | None = None  # (path, version) of the last load that reached a server
        self._changed = asyncio.Event()  # set whenever a server may have become usable
        self._http = httpx.AsyncClient(timeout=probe_timeout_s)

    def for_trajectory(self) -> StickyEngine:
        """An engine view that keeps every turn of one trajectory on one server."""
        return StickyEngine(self)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """One generation on the least-loaded usable server (no stickiness)."""
        return await self._generate(None, prompt_ids, params)

    async def load_weights(self, path: str, version: int) -> None:
        """Load `path` into every server that is up (see the module docstring); down ones reload when back."""
        targets = [server for server in self.servers if not server.failures]
        results = await asyncio.gather(*(self._load(server, path, version) for server in targets),
                                       return_exceptions=True)
        loaded = [server.url for server, result in zip(targets, results, strict=True) if result is None]
        failed: dict[str, BaseException] = {
            server.url: result for server, result in zip(targets, results, strict=True)
            if isinstance(result, BaseException)}
        for server in self.servers:
            if server.failures and server not in targets:
                failed[server.url] = RuntimeError(f"down ({server.last_error})")
        if not loaded:
            where = "; ".join(f"{url}: {exc}" for url, exc in failed.items())
            if all(isinstance(exc, ValueError) for exc in failed.values()):
                raise ValueError(f"every engine server refused {path}: {where}")
            raise RuntimeError(f"no engine server loaded {path}: {where}")
        self._weights = (path, version)
        self.policy_version = version
        for server in self.servers:
            if server.policy_version != version:
                server.stale = True  # a server that failed, or was down: out until a probe reloads it
        if failed:
            log.warning("policy version %d on %d of %d engine servers; out until they load it: %s", version,
                        len(loaded), len(self.servers), "; ".join(f"{u}: {e}" for u, e in failed.items()))
        self._changed.set()

    async def close(self) -> None:
        for server in self.servers:
            if server.probe is not None:
                server.probe.cancel()
        await asyncio.gather(*(server.engine.close() for server in self.servers), return_exceptions=True)
        await self._http.aclose()

    # -- routing ---------------------------------------------------------------------------------------------

    async def _generate(self, view: StickyEngine | None, prompt_ids: list[int], params: SamplingParams) -> Generation:
        reasons: dict[str, str] = {}
        tried: set[str] = set()
        deadline = time.monotonic() + self.wait_s
        while True:
            server = self._pick(view, tried)
            if server is None:
                if time.monotonic() >= deadline:
                    where = "; ".join(f"{s.url}: {reasons.get(s.url) or s.last_error or self._state(s)}"
                                      for s in self.servers)
                    raise RuntimeError(f"no engine server could generate this turn within {self.wait_s:g} s: "
                                       f"{where}")
                await self._wait(deadline)
                tried.clear()  # a server that failed this turn may have been probed back meanwhile
                continue
            tried.add(server.url)
            try:
                gen = await self._call(server, prompt_ids, params)
            except ValueError:
                raise
            except Exception as exc:
                reason = f"{type(exc).__name__}: {exc}"
                reasons[server.url] = reason
                self._mark_down(server, reason)
                log.warning("engine server %s failed a turn (%s); trying another", server.url, reason)
                if view is not None:
                    view.server = None
                continue
            if view is not None and view.server is not server:
                view.server = server
                server.trajectories += 1
            return gen

    def _usable(self, server: Server) -> bool:
        return server.up and not server.loading and server.policy_version == self.policy_version

    def _pick(self, view: StickyEngine | None, tried: set[str]) -> Server | None:
        self._start_probes()
        if view is not None and view.server is not None and self._usable(view.server) \
                and view.server.url not in tried:
            return view.server
        usable = [s for s in self.servers if self._usable(s) and s.url not in tried]
        return min(usable, key=lambda s: (s.in_flight, s.trajectories)) if usable else None

    def _state(self, server: Server) -> str:
        if server.loading:
            return "loading weights"
        if server.stale:
            return f"stale (has version {server.policy_version}, pool {self.policy_version})"
        return "down" if server.failures else "up"

    async def _wait(self, deadline: float) -> None:
        """Until a server may have become usable, the next probe is due, or the deadline."""
        self._changed.clear()
        due = [s.down_until for s in self.servers if not s.up and s.probe is None]
        until = min([deadline, *due]) if due else deadline
        try:
            await asyncio.wait_for(self._changed.wait(), timeout=max(0.01, until - time.monotonic()))
        except asyncio.TimeoutError:  # the builtin TimeoutError only from Python 3.11
            pass

    async def _call(self, server: Server, prompt_ids: list[int], params: SamplingParams) -> Generation:
        now = time.monotonic()
        if server.in_flight == 0:
            server._busy_since = now
        server.in_flight += 1
        server.requests += 1
        try:
            gen = await server.engine.generate(prompt_ids, params)
        except ValueError:
            raise
        except Exception:
            server.errors += 1
            raise
        finally:
            server.in_flight -= 1
            if server.in_flight == 0:
                server.busy_s += time.monotonic() - server._busy_since
                self._changed.set()  # a draining server may load now
        server.tokens += len(gen.token_ids)
        return gen

    def _mark_down(self, server: Server, reason: str) -> None:
        """Out as services/outage.py says; weights loaded while it is down are reloaded when it is back."""
        if mark_down(server, reason, self.down_s) and self._weights is not None:
            server.stale = True  # it may have restarted with its start-up weights

    # -- probes and reloads ----------------------------------------------------------------------------------

    def _start_probes(self) -> None:
        now = time.monotonic()
        for server in self.servers:
            if not server.up and not server.loading and server.probe is None and server.down_until <= now:
                server.probe = asyncio.create_task(self._probe(server))

    async def _probe(self, server: Server) -> None:
        try:
            try:
                response = await self._http.get(f"{server.url}/health")
                ok, why = response.status_code == 200, f"/health answered {response.status_code}"
            except httpx.HTTPError as exc:
                ok, why = False, f"/health: {type(exc).__name__}: {exc}"
            # Reload until it has the pool's version (a load may finish after the pool moved on again).
            while ok and self._weights is not None and (server.stale or server.policy_version != self.policy_version):
                path, version = self._weights
                try:
                    await self._load(server, path, version)
                except Exception as exc:
                    ok, why = False, f"reload of {path}: {type(exc).__name__}: {exc}"
            if ok:
                server.failures, server.stale, server.last_error = 0, False, ""
                log.warning("engine server %s is back (policy version %d)", server.url, server.policy_version)
                self._changed.set()
            else:
                self._mark_down(server, why)
        finally:
            server.probe = None

    async def _load(self, server: Server, path: str, version: int) -> None:
        """Drain `server`, then load `path` into it; on failure it is down and stale."""
        server.loading = True
        try:
            while server.in_flight:
                self._changed.clear()
                await self._changed.wait()
            await server.engine.load_weights(path, version)
        except BaseException as exc:
            server.stale = True
            server.last_error = f"weight load failed: {type(exc).__name__}: {exc}"
            server.failures = max(server.failures, 1)
            server.down_until = time.monotonic() + self.down_s
            raise
        finally:
            server.loading = False
            self._changed.set()
        server.stale = False


class StickyEngine:
    """The pool seen by one trajectory: its first turn picks a server, later turns stay there while it is usable."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool
        self.server: Server | None = None

    @property
    def policy_version(self) -> int:
        return self.pool.policy_version

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        return await self.pool._generate(self, prompt_ids, params)

    async def load_weights(self, path: str, version: int) -> None:
        await self.pool.load_weights(path, version)

    async def close(self) -> None:
        """The pool outlives its trajectories: nothing to release."""


def for_trajectory(engine: Engine) -> Engine:
    """The engine one trajectory should use: a sticky view for a pool (or an engine wrapping one), else itself."""
    route = getattr(engine, "for_trajectory", None)
    return route() if callable(route) else engine
