"""Test data of the viewer and SIS-record tests: real trajectories made by the gateway's own batch runner
(scripted policy, the real SmolLM2 tokenizer and Search-R1 protocol, an in-process searcher over a few
passages), stored in a SQLite file; and SIS records shaped as the trainer posts them."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from sisrl.common.models import load_tokenizer
from sisrl.services import store
from sisrl.services.agent import SearchR1Protocol
from sisrl.services.metrics import GatewayMetrics
from sisrl.services.retrieval_client import Passage
from sisrl.services.rewards import DEFAULT_SPECS
from sisrl.services.runner import BatchRunner, RunnerDeps
from sisrl.services.schemas import RolloutCreate
from sisrl.services.scripted import ScriptedEngine, ScriptRule
from sisrl.services.timing import BusyClock

RUN = "viewer-run"
PASSAGES = [
    Passage(id="101", title='"Mira Tolk"', text="Mira Tolk (born 1801) was a weaver from Dalmere.", score=0.0),
    Passage(id="102", title='"Dalmere"', text="Dalmere is a small town in the pine valley. It was founded in 1234.",
            score=0.0),
    Passage(id="103", title='"Kel Brun"', text="Kel Brun (born 1766) was a potter from Osk.", score=0.0),
]
# question, gold answers, data source; the script below searches for the first two and answers the rest at once
ITEMS = [
    ("What did Mira Tolk do for a living?", ["weaver"], "nq"),
    ("In which year was Dalmere founded?", ["1234"], "hotpotqa"),
    ("Where was Kel Brun born?", ["Osk"], "nq"),
    ("What is the capital of Dalmere county?", ["Pinehold"], "hotpotqa"),
]
RULES = [
    ScriptRule("Mira Tolk", ("<search> Mira Tolk </search>", "<think>The passage says weaver.</think> <answer> weaver </answer>")),
    ScriptRule("Dalmere founded", ("<search> Dalmere town </search>", "<answer> 1234 </answer>")),
    ScriptRule("Kel Brun", ("<think>I remember this one.</think> <answer> Osk </answer>",)),
    ScriptRule("", ("<answer> Dalmere </answer>",)),
]
STEPS = 2
SAMPLES = 2


class PassageSearcher:
    """The environment's retriever, in-process: passages ranked by words shared with the query. `before_search`,
    when set, runs once before the next search (a weight load that lands while trajectories run)."""

    def __init__(self) -> None:
        self.before_search: Callable[[], Awaitable[None]] | None = None

    async def search(self, query: str) -> list[Passage]:
        if self.before_search is not None:
            hook, self.before_search = self.before_search, None
            await hook()
        words = set(re.findall(r"\w+", query.lower()))
        scored = [(len(words & set(re.findall(r"\w+", (p.title + " " + p.text).lower()))), p) for p in PASSAGES]
        ranked = sorted(scored, key=lambda pair: (-pair[0], pair[1].id))[:2]
        return [Passage(id=p.id, title=p.title, text=p.text, score=float(n)) for n, p in ranked]


async def _roll(sessions: Any, tokenizer: Any) -> None:
    clock = BusyClock()
    searcher = PassageSearcher()
    deps = RunnerDeps(engine=ScriptedEngine(tokenizer, RULES), searcher=searcher,
                      protocol=SearchR1Protocol(tokenizer, observation_max_tokens=96), sessions=sessions,
                      metrics=GatewayMetrics(clock), clock=clock, reward_specs=dict(DEFAULT_SPECS),
                      max_response_tokens=512)
    runner = BatchRunner(deps, max_concurrency=8)
    for step in range(STEPS):
        if step == STEPS - 1:  # partial rollouts: version `step` lands while the first search of the batch runs
            searcher.before_search = partial(runner.gate.load, "scripted", step, partial=True)
        request = RolloutCreate.model_validate({
            "run": RUN, "step": step, "policy_version": step, "samples_per_item": SAMPLES, "max_turns": 3,
            "items": [{"id": f"q{i}", "question": q, "golden_answers": gold, "data_source": source}
                      for i, (q, gold, source) in enumerate(ITEMS)],
            "sampling": {"max_new_tokens": 64, "logprobs_k": 5, "seed": step}})
        batch_id = f"batch-{step}"
        with sessions() as session:
            store.create_batch(session=session, batch_id=batch_id, run=RUN, step=step, idempotency_key=None,
                               request_hash="-", request_json=request.model_dump_json(), total=len(ITEMS) * SAMPLES)
        runner.start(batch_id=batch_id, request=request,
                     todo=[(i, s) for i in range(len(ITEMS)) for s in range(SAMPLES)])
        while runner.is_running(batch_id):
            await asyncio.sleep(0.01)


@dataclass(frozen=True)
class ViewerStore:
    db_url: str
    trajectories: list[dict[str, Any]]  # every stored trajectory, as GET /v1/rollouts/{id} serves it (no `sis`)


def fill_store(db_url: str) -> ViewerStore:
    """Roll out STEPS batches of ITEMS x SAMPLES into a fresh store; return them."""
    sessions = store.open_db(db_url)
    try:
        asyncio.run(_roll(sessions, load_tokenizer()))
        with sessions() as session:
            rows, _ = store.list_trajectories(session=session, run=RUN, limit=1000)
            trajectories = [store.to_trajectory(row).model_dump(mode="json") for row in rows]
    finally:
        store.dispose(sessions)
    assert len(trajectories) == STEPS * len(ITEMS) * SAMPLES and all(t["error"] is None for t in trajectories)
    assert any(len({v for v in t["token_versions"] if v >= 0}) == 2 for t in trajectories)  # a load mid-trajectory
    return ViewerStore(db_url=db_url, trajectories=trajectories)


def sis_record(trajectory: dict[str, Any], *, seed: int, policy_version: int | None = None) -> dict[str, Any]:
    """A record as the trainer posts it: a seeded decision per policy token (60 % accepted, 30 % rejected,
    10 % outside V_K), -1 on inserted tokens; log pi drawn near log q, ratio 1 where accepted."""
    rng = np.random.default_rng(seed)
    mask = np.asarray(trajectory["loss_mask"])
    logq = np.asarray(trajectory["behaviour_logprobs"], dtype=np.float32)
    n = len(mask)
    status = np.where(mask == 1, rng.choice([1, 0, 2], size=n, p=[0.6, 0.3, 0.1]), -1)
    logp = np.where(mask == 1, logq - rng.random(n).astype(np.float32), 0.0).astype(np.float32)
    ratio = np.where(status == 1, 1.0, np.exp(logp - logq)).astype(np.float32)
    ratio[mask == 0] = 0.0
    return {"trajectory_id": trajectory["id"], "policy_version": trajectory["policy_version"] + 1
            if policy_version is None else policy_version,
            "advantage": float(np.float32(rng.normal())), "status": status.tolist(), "ratio": ratio.tolist(),
            "logp": logp.tolist(), "log_m": np.zeros(n, np.float32).tolist()}
