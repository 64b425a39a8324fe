"""bench/turn_sync.py, the turn-synchronous baseline of bench/gateway.py, on the gateway's own runner with the real
tokenizer and a scripted policy: a group's trajectories generate in lock step turn by turn, the next group starts
after the whole group, and a barrier wait counts neither as engine time nor as engine busy time."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

from sisrl.common.models import load_tokenizer
from sisrl.services import store
from sisrl.services.agent import SearchR1Protocol
from sisrl.services.engines.base import Generation, SamplingParams
from sisrl.services.metrics import GatewayMetrics
from sisrl.services.retrieval_client import Passage
from sisrl.services.rewards import DEFAULT_SPECS
from sisrl.services.runner import BatchRunner, RunnerDeps
from sisrl.services.schemas import RolloutCreate, RolloutItem, SamplingIn, Trajectory
from sisrl.services.scripted import ScriptedEngine, ScriptRule
from sisrl.services.timing import BusyClock

SEARCHES = [0, 2, 3, 1, 2]  # per question; questions 0-2 are the first group (C = 3), 3-4 the second
SEARCH_S = [0.0, 0.15, 0.01, 0.1, 0.01]  # retriever latency per question: 1 holds 2 back at every turn


def _turn_sync() -> ModuleType:
    """bench/turn_sync.py by path (bench/ is no package)."""
    path = Path(__file__).resolve().parents[2] / "bench" / "turn_sync.py"
    spec = importlib.util.spec_from_file_location("bench_turn_sync", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_turn_sync"] = module
    spec.loader.exec_module(module)
    return module


class Recording:
    """The scripted policy; `calls` lists the question index of every generation, in call order."""

    def __init__(self, scripted: ScriptedEngine) -> None:
        self.scripted = scripted
        self.policy_version = 0
        self.calls: list[int] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        found = re.search(r"question number (\d+)", self.scripted.tokenizer.decode(prompt_ids))
        assert found is not None
        self.calls.append(int(found.group(1)))
        return await self.scripted.generate(prompt_ids, params)

    async def load_weights(self, path: str, version: int) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class Sleepy:
    """A retriever whose latency depends on the question: query `qI` takes SEARCH_S[I] seconds."""

    async def search(self, query: str) -> list[Passage]:
        await asyncio.sleep(SEARCH_S[int(query.strip()[1:])])
        return [Passage(id="1", title="T", text="some text", score=1.0)]


def test_groups_advance_in_lock_step(tmp_path: Path) -> None:
    tokenizer = load_tokenizer()
    rules = [ScriptRule(match=f"question number {i}", turns=(f"<search>q{i}</search>",) * n + ("<answer>x</answer>",))
             for i, n in enumerate(SEARCHES)]
    engine = Recording(ScriptedEngine(tokenizer, rules))
    clock = BusyClock()
    deps = RunnerDeps(engine=engine, searcher=Sleepy(), protocol=SearchR1Protocol(tokenizer),
                      sessions=store.open_db(f"sqlite:///{tmp_path / 'unused.db'}"), metrics=GatewayMetrics(clock),
                      clock=clock, reward_specs=dict(DEFAULT_SPECS), max_response_tokens=4096)
    items = [RolloutItem(id=f"q{i}", question=f"question number {i}", golden_answers=["x"], data_source="nq")
             for i in range(len(SEARCHES))]
    request = RolloutCreate(run="t", step=0, policy_version=0, items=items, max_turns=8,
                            sampling=SamplingIn(max_new_tokens=64, logprobs_k=2, seed=0))
    done: dict[str, Trajectory] = {}
    asyncio.run(_turn_sync().run_turn_synchronous(BatchRunner(deps, max_concurrency=3), request, concurrency=3,
                                                  on_done=lambda t: done.__setitem__(t.item_id, t)))

    assert [len(done[f"q{i}"].turns) for i in range(5)] == SEARCHES
    assert all(t.finish_reason == "answer" for t in done.values())
    # Turn number of every generation in call order: within a group no turn starts before every live
    # trajectory of the group has ended the one before (without the barrier, 2 runs ahead of 1).
    seen: dict[int, int] = {}
    turns = []
    for q in engine.calls:
        turns.append((q >= 3, seen.get(q, 0)))
        seen[q] = seen.get(q, 0) + 1
    assert turns == sorted(turns)  # and the second group only after the whole first one
    assert turns.count((False, 0)) == 3 and turns.count((True, 0)) == 2
    # Question 2 waited at the barrier for question 1's two slow searches (>= 2 x 0.14 s): that wait is its
    # own time (total - engine - retriever), not engine time, and the engine was busy for less than it.
    timings = done["q2"].timings
    own = timings["total_s"] - timings["engine_s"] - timings["retriever_s"]
    assert own > 0.25 and timings["engine_s"] < own
    assert clock.busy_s["engine"] < clock.busy_s["retriever"] - 0.25
