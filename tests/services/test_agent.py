"""The agent loop in-process with the real tokenizer and the real retriever: corrective message, turn and
token budgets, observation truncation that keeps the closing tag, and an engine failure recorded."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sisrl.common.models import load_tokenizer
from sisrl.services.agent import AgentLimits, Rollout, SearchR1Protocol, run_agent
from sisrl.services.engines.base import Generation, SamplingParams
from sisrl.services.retrieval_client import Passage, RetrievalClient
from sisrl.services.scripted import ScriptedEngine, ScriptRule


@pytest.fixture(scope="module")
def protocol() -> SearchR1Protocol:
    return SearchR1Protocol(load_tokenizer(), observation_max_tokens=64)


def _run(protocol: SearchR1Protocol, engine: Any, retriever_url: str, *, turns: int = 4,
         budget: int = 2048) -> Rollout:
    async def go() -> Rollout:
        client = RetrievalClient(retriever_url, topk=2)
        try:
            return await run_agent(engine=engine, searcher=client, protocol=protocol, question="isle of wight?",
                                   params=SamplingParams(max_new_tokens=64, logprobs_k=3),
                                   limits=AgentLimits(max_turns=turns, max_response_tokens=budget))
        finally:
            await client.aclose()
    return asyncio.run(go())


def test_observation_truncation_keeps_closing_tag(protocol: SearchR1Protocol) -> None:
    long = [Passage(id=str(i), title=f'"Title {i}"', text="word " * 200, score=1.0) for i in range(3)]
    ids = protocol.observation_ids(long)
    text = protocol.decode(ids)
    assert len(ids) == 64 and text.startswith("\n\n<information>Doc 1(Title: \"Title 0\") word")
    assert text.endswith("</information>\n\n") and "Doc 2" not in text
    with pytest.raises(ValueError, match="observation_max_tokens=8"):
        SearchR1Protocol(protocol.tokenizer, observation_max_tokens=8)


def test_invalid_action_gets_corrective_message(protocol: SearchR1Protocol, retriever_url: str) -> None:
    engine = ScriptedEngine(protocol.tokenizer, [ScriptRule("", ("no tags here </search>", "<answer>x</answer>"))])
    rollout = _run(protocol, engine, retriever_url)
    first = protocol.encode("no tags here </search>")
    assert rollout.finish_reason == "answer" and rollout.valid_actions == 1 and rollout.searches == []
    assert rollout.response_ids[len(first):len(first) + len(protocol.corrective_ids)] == protocol.corrective_ids
    n = len(protocol.corrective_ids)
    assert rollout.loss_mask == [1] * len(first) + [0] * n + [1] * (len(rollout.response_ids) - len(first) - n)


def test_turn_and_token_budgets(protocol: SearchR1Protocol, retriever_url: str) -> None:
    engine = ScriptedEngine(protocol.tokenizer, [ScriptRule("", ("<search>isle of wight</search>",))])
    rollout = _run(protocol, engine, retriever_url, turns=2)
    # Two searches sampled, one observation: no retrieval is made for a turn that cannot follow.
    assert rollout.finish_reason == "max_turns" and len(rollout.searches) == 1 and len(rollout.turn_texts) == 2
    assert rollout.loss_mask.count(0) == 64 and rollout.error is None
    # Budget 100 counts sampled + inserted tokens: search (s) + observation (64) + search (s) = 64 + 2s <= 100;
    # the second observation would pass 100, so it is not inserted and the trajectory ends at "length".
    short = _run(protocol, engine, retriever_url, turns=8, budget=100)
    s = len(protocol.encode("<search>isle of wight</search>"))
    assert short.finish_reason == "length" and len(short.response_ids) == 64 + 2 * s <= 100
    assert short.loss_mask.count(0) == 64 and len(short.searches) == 1


class FailingEngine:
    """Failure handling: an engine whose generate raises."""

    policy_version = 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        raise RuntimeError("device lost")

    async def load_weights(self, path: str, version: int) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        return None


def test_engine_failure_is_recorded(protocol: SearchR1Protocol, retriever_url: str) -> None:
    rollout = _run(protocol, FailingEngine(), retriever_url)
    assert (rollout.finish_reason, rollout.error) == ("error", "engine: RuntimeError: device lost")
    assert rollout.response_ids == [] and "engine_s" in rollout.timings
