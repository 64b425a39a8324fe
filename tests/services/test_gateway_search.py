"""Rollouts with a real search: scripted policy turns (the workload driver), the real retriever over shared
passages, a real gateway subprocess. Checks the observation, token exactness, rewards, queries and stats."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sisrl.common.models import load_tokenizer
from sisrl.services.agent import SearchR1Protocol
from sisrl.services.retrieval_client import Passage, RetrievalClient

SEARCH_TURN = "<think>I need to look this up.</think>\n<search>vampire diaries number of seasons</search>"
ANSWER_TURN = "<think>The passage says.</think>\n<answer>Eight</answer>"
SCRIPT = {"rules": [
    {"match": "vampire diaries", "turns": [SEARCH_TURN, ANSWER_TURN]},
    {"match": "", "turns": ["<answer>no idea</answer>"]},
]}


@pytest.fixture(scope="module")
def gateway(start_gateway: Callable[..., Any], retriever_url: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    script = tmp_path_factory.mktemp("script") / "script.json"
    script.write_text(json.dumps(SCRIPT))
    # The retriever as Search-R1's retriever.url names it, its /retrieve endpoint: the same server as the base URL
    # the other gateways get (test_the_retriever_is_named_once_as_its_endpoint).
    return start_gateway("--engine", "scripted", "--script", str(script), "--retriever-url",
                         f"{retriever_url}/retrieve/", "--topk", "3", "--observation-max-tokens", "400")


def _segments(mask: list[int], ids: list[int]) -> list[tuple[int, list[int]]]:
    out: list[tuple[int, list[int]]] = []
    for m, tok in zip(mask, ids, strict=True):
        if out and out[-1][0] == m:
            out[-1][1].append(tok)
        else:
            out.append((m, [tok]))
    return out


def test_search_rollout_end_to_end(gateway: Any, qa_subset: Any, make_body: Callable[..., dict[str, Any]],
                                   to_item: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    vampire = next(r for r in qa_subset.nq if "vampire diaries" in r["question"])
    other = next(r for r in qa_subset.nq if r is not vampire)
    body = make_body([to_item(vampire), to_item(other)], run="search", samples_per_item=2, max_turns=3,
                     sampling={"max_new_tokens": 64, "logprobs_k": 5, "seed": 3})
    created = gateway.client.post("/v1/rollouts", json=body).raise_for_status().json()
    batch = gateway.wait_batch(created["batch_id"])
    assert batch["status"] == "done" and batch["progress"] == {"done": 4, "total": 4} and not batch["missing_items"]
    by_item: dict[str, list[dict[str, Any]]] = {}
    for traj in batch["trajectories"]:
        by_item.setdefault(traj["item_id"], []).append(traj)

    tokenizer = load_tokenizer()
    protocol = SearchR1Protocol(tokenizer, observation_max_tokens=400)
    for traj in by_item[vampire["id"]]:
        assert (traj["finish_reason"], traj["answer"], traj["reward"], traj["error"]) == ("answer", "Eight", 1.0, None)
        assert traj["reward_parts"] == {"em": 1.0, "f1": 1.0, "format": 1.0}
        (turn,) = traj["turns"]
        assert turn["query"] == "vampire diaries number of seasons" and len(turn["doc_ids"]) == 3
        assert turn["scores"] == sorted(turn["scores"], reverse=True)
        segments = _segments(traj["loss_mask"], traj["response_ids"])
        assert [m for m, _ in segments] == [1, 0, 1]
        observation = tokenizer.decode(segments[1][1])
        assert observation.startswith("\n\n<information>Doc 1(Title: ") and observation.endswith("</information>\n\n")
        for i, doc_id in enumerate(turn["doc_ids"], start=1):
            assert f"Doc {i}(Title: {qa_subset.titles[doc_id]})" in observation
        # Token exactness: sampled ids + the observation ids built from the same passages, nothing re-tokenised.
        docs = {json.loads(line)["id"]: json.loads(line)["contents"] for line in Path(qa_subset.corpus).open()}
        passages = [Passage(id=d, title=docs[d].split("\n", 1)[0], text=docs[d].split("\n", 1)[1], score=s)
                    for d, s in zip(turn["doc_ids"], turn["scores"], strict=True)]
        expected = protocol.encode(SEARCH_TURN) + protocol.observation_ids(passages) + protocol.encode(ANSWER_TURN)
        assert traj["response_ids"] == expected
        assert traj["prompt_ids"] == protocol.prompt_ids(vampire["question"])
        assert all(lp == 0.0 for lp in traj["behaviour_logprobs"])
        assert all(row == [0] * 5 for row, m in zip(traj["topk_ids"], traj["loss_mask"], strict=True) if m == 0)
    for traj in by_item[other["id"]]:
        assert (traj["finish_reason"], traj["answer"], traj["reward"], traj["turns"]) == ("answer", "no idea", 0.0, [])
    groups = {item: {t["group_id"] for t in trajs} for item, trajs in by_item.items()}
    assert all(len(g) == 1 for g in groups.values()) and groups[vampire["id"]] != groups[other["id"]]


def test_the_retriever_is_named_once_as_its_endpoint(gateway: Any, retriever_url: str) -> None:
    """Given as `.../retrieve/`, the retriever is posted to at `.../retrieve` (the end-to-end test above searched
    through it), and the start-up line and check say so."""
    log = gateway.log.read_text()
    assert f"; retriever {retriever_url}/retrieve)" in log and "/retrieve/retrieve" not in log
    assert "does not answer" not in log  # the start-up check's query was answered


def test_queries_stats_stream_and_metrics(gateway: Any, qa_subset: Any) -> None:
    """Runs after the end-to-end test (same module): 4 stored trajectories of run 'search'."""
    client = gateway.client
    winners = client.get("/v1/rollouts", params={"run": "search", "reward_min": 1.0}).json()
    assert winners["count"] == 2 and all(t["reward"] == 1.0 for t in winners["data"])
    assert client.get("/v1/rollouts", params={"run": "search", "data_source": "hotpotqa"}).json()["count"] == 0
    assert client.get("/v1/rollouts", params={"run": "search", "step_min": 1}).json()["count"] == 0
    seen, cursor = [], None
    while True:
        page = client.get("/v1/rollouts", params={"run": "search", "limit": 1, **({"cursor": cursor} if cursor else {})}).json()
        seen += [t["id"] for t in page["data"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == len(set(seen)) == 4
    one = client.get(f"/v1/rollouts/{seen[0]}").json()
    assert one["id"] == seen[0] and len(one["response_ids"]) == len(one["loss_mask"])
    assert client.get("/v1/rollouts/nope").status_code == 404

    (step,) = client.get("/v1/runs/search/stats").json()["data"]
    assert step["trajectories"] == 4 and step["em_by_source"] == {"nq": 0.5} and step["searches_mean"] == 0.5
    assert step["finish_reasons"] == {"answer": 4} and step["reward_mean"] == 0.5

    batch_id = one["batch_id"]
    lines = client.get(f"/v1/batches/{batch_id}/stream").text.strip().split("\n")
    assert sorted(json.loads(line)["id"] for line in lines) == sorted(seen)
    metrics = client.get("/metrics").text
    assert 'sisrl_gateway_trajectories_total{data_source="nq",finish_reason="answer"} 4.0' in metrics
    assert "sisrl_gateway_retriever_queries_total 2.0" in metrics
    assert client.get("/health").json()["engine"] == "scripted"


def test_concurrent_queries_are_coalesced(retriever_url: str) -> None:
    """Five trajectories searching at once share one /retrieve request; each gets its own query's answer."""
    queries = ["vampire diaries seasons", "isle of wight island", "hot coffee mod", "battle of bull run", "danja"]
    calls: list[tuple[str, float]] = []

    async def run() -> tuple[list[list[Passage]], list[list[Passage]]]:
        client = RetrievalClient(retriever_url, topk=2, window_s=0.02, on_request=lambda o, n: calls.append((o, n)))
        together = await asyncio.gather(*(client.search(q) for q in queries))
        alone = [(await client.search_many([q]))[0] for q in queries]
        await client.aclose()
        return list(together), alone

    together, alone = asyncio.run(run())
    assert calls[0] == ("ok", 5.0) and len(calls) == 1 + len(queries)
    assert [[p.id for p in hits] for hits in together] == [[p.id for p in hits] for hits in alone]
    assert all(len(hits) == 2 for hits in together)
