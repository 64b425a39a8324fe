"""The agent loop in-process with the real tokenizer and the real retriever: corrective message, turn and
token budgets, observation truncation that keeps the closing tag, an engine failure recorded, and a weight load
that lands mid-trajectory (partial rollouts)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from sisrl.common.models import build_tiny_policy, load_tokenizer
from sisrl.common.wire import MIN_LOGPROB
from sisrl.services.agent import AgentLimits, Rollout, SearchR1Protocol, run_agent
from sisrl.services.engines.base import Generation, SamplingParams
from sisrl.services.engines.local import LocalEngine
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


def test_a_load_mid_trajectory_gives_each_token_its_versions_log_prob(
    protocol: SearchR1Protocol, retriever_url: str, tmp_path: Path
) -> None:
    """Partial rollouts through the agent loop: four trajectories of the tiny policy run on the local engine, and
    version 1 lands (`load_weights_mid_request`) while they are in a later turn. Inserted tokens (corrective
    messages, passages) carry no version and loss mask 0; every sampled token's recorded log-prob and top-K
    equal a fresh forward pass, over the whole trajectory so far, of the version that sampled it."""
    torch.manual_seed(0)
    tokenizer = protocol.tokenizer
    policies = {0: build_tiny_policy(tokenizer, seed=0).eval(), 1: build_tiny_policy(tokenizer, seed=1).eval()}
    policies[1].save_pretrained(tmp_path / "v1", safe_serialization=True)
    params = SamplingParams(max_new_tokens=24, logprobs_k=3, seed=3)
    questions = ["isle of wight?", "who wrote hamlet?", "capital of peru?", "tallest mountain?"]

    async def go() -> list[Rollout]:
        engine = LocalEngine(build_tiny_policy(tokenizer, seed=0), tokenizer=tokenizer)
        client = RetrievalClient(retriever_url, topk=2)
        try:
            running = [asyncio.create_task(run_agent(
                engine=engine, searcher=client, protocol=protocol, question=q, params=replace(params, seed=i),
                limits=AgentLimits(max_turns=3, max_response_tokens=512))) for i, q in enumerate(questions)]
            while engine.stats.generated_tokens < 36 * len(questions):  # every trajectory is in its second turn
                await asyncio.sleep(0.001)
            await engine.load_weights_mid_request(str(tmp_path / "v1"), 1)
            return list(await asyncio.gather(*running))
        finally:
            await client.aclose()
            await engine.close()

    rollouts = asyncio.run(go())
    spans_load = 0
    for r in rollouts:
        assert r.error is None and len(r.token_versions) == len(r.response_ids) == len(r.loss_mask)
        assert [v == -1 for v in r.token_versions] == [m == 0 for m in r.loss_mask]
        versions = [v for v in r.token_versions if v >= 0]
        assert versions == sorted(versions) and set(versions) <= {0, 1}
        first_new = r.token_versions.index(1) if 1 in r.token_versions else len(r.response_ids)
        spans_load += 0 in versions and 1 in versions and 0 in r.loss_mask[:first_new]
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        start = len(r.prompt_ids)
        for version, policy in policies.items():
            at = [t for t, v in enumerate(r.token_versions) if v == version]
            if not at:
                continue
            with torch.no_grad():
                logits = policy(input_ids=ids).logits[0, start - 1:-1].double()
            logq = torch.log_softmax(logits, dim=-1).clamp(min=MIN_LOGPROB)[at]  # [T_v, V]
            picked = logq.gather(-1, torch.tensor([r.response_ids[t] for t in at]).unsqueeze(-1)).squeeze(-1)
            assert (picked - torch.tensor([r.logprobs[t] for t in at])).abs().max().item() <= 1e-4, version
            top = logq.gather(-1, torch.tensor([r.topk_ids[t] for t in at]))
            assert (top - torch.tensor([r.topk_logprobs[t] for t in at])).abs().max().item() <= 1e-4, version
    assert spans_load >= 1  # a trajectory with tokens of both versions and an inserted span before the load
