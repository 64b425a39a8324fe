"""Batch execution: one asyncio task per trajectory, bounded by a semaphore, each stored as it finishes.

There is no turn barrier: a trajectory that answers at once frees its slot for a queued one while others are
still searching. Every finished trajectory is committed to the store before it counts as done, so a gateway
killed mid-batch loses only trajectories that were still running. A batch started here is released from this
process's claim (`claims`) once its final status is stored, so another gateway can resume it only after that.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

from sisrl.common import arrow_wire
from sisrl.services import store
from sisrl.services.agent import AgentLimits, Rollout, Searcher, SearchR1Protocol, run_agent
from sisrl.services.claims import Claims, LocalClaims
from sisrl.services.engines.base import Engine, SamplingParams
from sisrl.services.engines.pool import for_trajectory
from sisrl.services.load_gate import GatedEngine, LoadGate
from sisrl.services.metrics import GatewayMetrics
from sisrl.services.protocol import ProtocolSpec
from sisrl.services.rewards import RewardSpec, reward_spec, score_response
from sisrl.services.schemas import ProtocolIn, RewardParts, RolloutCreate, RolloutItem, Trajectory, Turn
from sisrl.services.timing import BusyClock
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)
_NS = uuid.UUID("6f1c2a5e-8d7b-4c1e-9a3f-5b2d7e9c0a41")  # fixed namespace: ids are reproducible
PROTOCOLS_KEPT = 16  # distinct request protocols whose token pieces a runner keeps (oldest dropped first)


def trajectory_id(batch_id: str, item_id: str, sample_index: int) -> str:
    return uuid.uuid5(_NS, f"{batch_id}/{item_id}/{sample_index}").hex


def group_id(batch_id: str, item_id: str) -> str:
    return uuid.uuid5(_NS, f"{batch_id}/{item_id}").hex


def protocol_spec(body: ProtocolIn) -> ProtocolSpec:
    """The agent's protocol of a request's `protocol`: its unset (null) fields take the gateway's defaults."""
    given = {name: value for name, value in body.model_dump().items() if value is not None}
    return ProtocolSpec(**given)


def sample_seed(seed: int | None, ordinal: int) -> int | None:
    """Per-trajectory seed (the agent adds the turn index), so samples of one group differ."""
    return None if seed is None else (seed + 7919 * ordinal) % 2**31


@dataclass
class RunnerDeps:
    engine: Engine
    searcher: Searcher
    protocol: SearchR1Protocol
    sessions: sessionmaker[Session]
    metrics: GatewayMetrics
    clock: BusyClock
    reward_specs: dict[str, RewardSpec]
    max_response_tokens: int
    topk_logprobs_dtype: str = "float32"  # GatewaySettings.topk_logprobs_dtype


class BatchRunner:
    """Schedules trajectories of submitted batches; `pending` counts queued + running ones. `claims` holds the
    batches this process runs (the caller claims a batch before `start`; the runner releases it at the end)."""

    def __init__(self, deps: RunnerDeps, *, max_concurrency: int, claims: Claims | None = None) -> None:
        self.deps = deps
        self.claims: Claims = claims if claims is not None else LocalClaims()
        self.gate = LoadGate(deps.engine)  # weight loads go through it (POST /v1/policy)
        self.pending = 0
        self._slots = asyncio.Semaphore(max_concurrency)
        self._batches: dict[str, set[asyncio.Task[None]]] = {}
        self._changed: dict[str, asyncio.Event] = {}
        self._finishers: set[asyncio.Task[None]] = set()
        self._protocols: dict[ProtocolSpec, SearchR1Protocol] = {}  # request protocols other than the gateway's

    def protocol_for(self, spec: ProtocolSpec) -> SearchR1Protocol:
        """The gateway's own protocol for its spec, else one built on its tokenizer and budget and kept for the
        next batches (the PROTOCOLS_KEPT newest); ValueError when the observation's tags fill the budget."""
        own = self.deps.protocol
        if spec == own.spec:
            return own
        if spec not in self._protocols:
            if len(self._protocols) >= PROTOCOLS_KEPT:
                self._protocols.pop(next(iter(self._protocols)))
            self._protocols[spec] = SearchR1Protocol(own.tokenizer, observation_max_tokens=own.default_max_tokens,
                                                     spec=spec)
        return self._protocols[spec]

    def is_running(self, batch_id: str) -> bool:
        return batch_id in self._batches

    def running_batches(self) -> list[str]:
        """Batches started here and not finished (after `shutdown`: the ones it interrupted)."""
        return list(self._batches)

    def start(self, *, batch_id: str, request: RolloutCreate, todo: list[tuple[int, int]]) -> None:
        """Run the (item index, sample index) pairs `todo` of a stored batch in the background."""
        self._set_pending(self.pending + len(todo))
        tasks = {asyncio.create_task(self._one(batch_id, request, i, s)) for i, s in todo}
        self._batches[batch_id] = tasks
        self._changed.setdefault(batch_id, asyncio.Event())
        finisher = asyncio.create_task(self._finish(batch_id, tasks))
        self._finishers.add(finisher)
        finisher.add_done_callback(self._finishers.discard)

    async def wait_change(self, batch_id: str, timeout: float) -> None:
        event = self._changed.setdefault(batch_id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        event.clear()

    async def shutdown(self) -> None:
        """Cancel every running trajectory; their batches stay `running` in the store until marked."""
        tasks = [t for batch in self._batches.values() for t in batch] + list(self._finishers)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _set_pending(self, value: int) -> None:
        self.pending = value
        self.deps.metrics.pending.set(value)

    def _notify(self, batch_id: str) -> None:
        self._changed.setdefault(batch_id, asyncio.Event()).set()

    async def _finish(self, batch_id: str, tasks: set[asyncio.Task[None]]) -> None:
        await asyncio.gather(*tasks, return_exceptions=True)
        status, first_error = await asyncio.to_thread(self._final_status, batch_id)
        self._batches.pop(batch_id, None)
        self._changed.pop(batch_id, asyncio.Event()).set()  # wakes streamers; they see the batch stopped
        if status == "failed":  # every trajectory ended with an error: most often one cause, named here
            log.warning("batch %s failed: every trajectory ended with an error, the first: %s", batch_id, first_error)
        else:
            log.info("batch %s finished: %s", batch_id, status)

    def _final_status(self, batch_id: str) -> tuple[str, str | None]:
        """Store and return the batch's final status, with the first trajectory error (None when none)."""
        with self.deps.sessions() as session:
            row = store.get_batch(session=session, batch_id=batch_id)
            assert row is not None, f"batch {batch_id} vanished from the store"
            stored, errors = store.count_errors(session=session, batch_id=batch_id)
            status = "partial" if stored < row.total else ("failed" if errors == stored else "done")
            store.set_batch_status(session=session, batch_id=batch_id, status=status)
            first_error = store.first_error(session=session, batch_id=batch_id) if errors else None
        self.claims.release(batch_id)  # after the status is committed: whoever claims next reads it
        return status, first_error

    async def _one(self, batch_id: str, request: RolloutCreate, item_index: int, sample_index: int) -> None:
        queued = time.perf_counter()
        try:
            async with self._slots, self.gate.trajectory():
                item = request.items[item_index]
                ordinal = item_index * request.samples_per_item + sample_index
                rollout = await self.rollout(item, request, seed=sample_seed(request.sampling.seed, ordinal))
                rollout.timings["queue_s"] = time.perf_counter() - queued - rollout.timings["total_s"]
            trajectory = self.to_trajectory(batch_id, request, item, sample_index, rollout)
            await asyncio.to_thread(self._store, trajectory, sample_index)
            self._notify(batch_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("trajectory %s/%s/%d crashed", batch_id, request.items[item_index].id, sample_index)
        finally:
            self._set_pending(self.pending - 1)

    async def rollout(self, item: RolloutItem, request: RolloutCreate, *, seed: int | None) -> Rollout:
        s = request.sampling
        params = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                logprobs_k=s.logprobs_k, seed=seed)
        limits = AgentLimits(max_turns=request.max_turns, max_response_tokens=self.deps.max_response_tokens)
        try:
            protocol = self.protocol_for(protocol_spec(request.protocol))
        except ValueError as exc:  # a budget its tags fill: every trajectory ends so, the batch fails naming why
            return Rollout(prompt_ids=[], k=params.logprobs_k, finish_reason="error", error=f"protocol: {exc}",
                           timings={"total_s": 0.0})
        return await run_agent(engine=GatedEngine(for_trajectory(self.deps.engine), self.gate), searcher=self.deps.searcher, protocol=protocol,
                               question=item.question, params=params, limits=limits, clock=self.deps.clock)

    def to_trajectory(self, batch_id: str, request: RolloutCreate, item: RolloutItem, sample_index: int,
                      rollout: Rollout) -> Trajectory:
        spec = reward_spec(item.data_source, self.deps.reward_specs)
        scored = score_response(turn_texts=rollout.turn_texts, valid_actions=rollout.valid_actions,
                                golden_answers=item.golden_answers, spec=spec)
        version = rollout.policy_version if rollout.policy_version is not None else self.deps.engine.policy_version
        self.deps.metrics.trajectories.labels(item.data_source, rollout.finish_reason).inc()
        self.deps.metrics.trajectory_seconds.observe(rollout.timings["total_s"])
        self.deps.metrics.reward.observe(scored.reward)
        return Trajectory(
            id=trajectory_id(batch_id, item.id, sample_index), batch_id=batch_id, item_id=item.id,
            group_id=group_id(batch_id, item.id), run=request.run, step=request.step,
            data_source=item.data_source, question=item.question, golden_answers=item.golden_answers,
            prompt_ids=rollout.prompt_ids, response_ids=rollout.response_ids, loss_mask=rollout.loss_mask,
            behaviour_logprobs=rollout.logprobs, topk_ids=rollout.topk_ids,
            topk_logprobs=(arrow_wire.round_to_half(rollout.topk_logprobs)
                           if self.deps.topk_logprobs_dtype == "float16" else rollout.topk_logprobs),
            token_versions=rollout.token_versions,
            turns=[Turn(query=t.query, doc_ids=t.doc_ids, scores=t.scores) for t in rollout.searches],
            finish_reason=rollout.finish_reason,  # type: ignore[arg-type]
            answer=scored.answer, reward=scored.reward,
            reward_parts=RewardParts(em=scored.em, f1=scored.f1, format=scored.format),
            policy_version=version, timings=rollout.timings, error=rollout.error,
        )

    def _store(self, trajectory: Trajectory, sample_index: int) -> None:
        with self.deps.sessions() as session:
            store.add_trajectory(session=session, trajectory=trajectory, sample_index=sample_index)
