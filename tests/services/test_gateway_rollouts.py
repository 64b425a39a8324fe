"""Real rollouts of the tiny policy through the local engine in a gateway subprocess: token invariants against
a fresh forward pass, bearer-token auth, and a policy weight update."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch
from sisrl.common.models import load_tokenizer
from sisrl.services.agent import SearchR1Protocol
from transformers import AutoModelForCausalLM

TEMPERATURE = 0.7
K = 5


def test_token_invariants_on_real_rollouts(local_gateway: Any, tiny_policy_dir: Path, qa_subset: Any,
                                           make_body: Callable[..., dict[str, Any]],
                                           to_item: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    items = [to_item(r) for r in qa_subset.nq[:2]]
    body = make_body(items, run="invariants", samples_per_item=2, max_turns=2,
                     sampling={"max_new_tokens": 16, "temperature": TEMPERATURE, "top_p": 1.0, "logprobs_k": K,
                               "seed": 11})
    before = _local_counters(local_gateway)
    batch_id = local_gateway.client.post("/v1/rollouts", json=body).raise_for_status().json()["batch_id"]
    batch = local_gateway.wait_batch(batch_id)
    assert batch["status"] == "done" and len(batch["trajectories"]) == 4
    after = _local_counters(local_gateway)
    done = {k: after[k] - before.get(k, 0.0) for k in after}
    generations = sum(1 + sum(a == 0 and b == 1 for a, b in zip(t["loss_mask"], t["loss_mask"][1:], strict=False))
                      for t in batch["trajectories"])
    assert done["requests"] == generations  # one engine request per turn
    assert done["generated_tokens"] == sum(sum(t["loss_mask"]) for t in batch["trajectories"])
    assert done["prompt_tokens"] >= sum(len(t["prompt_ids"]) for t in batch["trajectories"])
    assert done["prefix_reused_tokens"] + done["shared_prefix_tokens"] <= done["prompt_tokens"]

    protocol = SearchR1Protocol(load_tokenizer())
    model = AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float32).eval()
    questions = {item["id"]: item["question"] for item in items}
    for traj in batch["trajectories"]:
        n = len(traj["response_ids"])
        assert traj["error"] is None and traj["policy_version"] == 0
        assert len(traj["loss_mask"]) == len(traj["behaviour_logprobs"]) == len(traj["topk_ids"]) == n
        assert all(len(row) == K for row in traj["topk_ids"] + traj["topk_logprobs"])
        assert traj["prompt_ids"] == protocol.prompt_ids(questions[traj["item_id"]])
        # ids = sampled + inserted: the random policy never emits a valid action, so each inserted piece is
        # exactly the corrective message's ids, one after each turn but the last (max_turns=2).
        inserted, run_, turns = [], [], 0
        for j, (tok, m) in enumerate(zip(traj["response_ids"], traj["loss_mask"], strict=True)):
            if m == 0:
                run_.append(tok)
            else:
                turns += j == 0 or traj["loss_mask"][j - 1] == 0  # a sampled run starts: one turn
                if run_:
                    inserted.append(run_)
                    run_ = []
        assert all(piece == protocol.corrective_ids for piece in inserted) and not run_
        assert traj["loss_mask"][0] == 1 and 1 <= turns <= 2
        assert len(inserted) == turns - 1  # one corrective message between two turns, none after the last
        assert turns == 2 or traj["finish_reason"] != "max_turns"  # max_turns: both turns were used
        for j, m in enumerate(traj["loss_mask"]):
            if m == 0:
                assert traj["behaviour_logprobs"][j] == 0.0 and traj["topk_ids"][j] == [0] * K
        # Behaviour log-probs = a fresh fp32 forward pass of the same weights at the same temperature.
        ids = torch.tensor([traj["prompt_ids"] + traj["response_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float() / TEMPERATURE, dim=-1)  # [time, vocab]
        start = len(traj["prompt_ids"])
        for j, m in enumerate(traj["loss_mask"]):
            if m == 0:
                continue
            row, tok = logp[start + j - 1], traj["response_ids"][j]
            assert abs(row[tok].item() - traj["behaviour_logprobs"][j]) <= 1e-4
            rank = int((row > row[tok]).sum().item()) + 1
            assert (tok in traj["topk_ids"][j]) == (rank <= K)
            assert set(traj["topk_ids"][j]) == set(torch.topk(row, K).indices.tolist())


def _local_counters(gateway: Any) -> dict[str, float]:
    """The `sisrl_gateway_local_*_total` counters of the gateway's in-process engine."""
    out = {}
    for line in gateway.client.get("/metrics").text.splitlines():
        if line.startswith("sisrl_gateway_local_") and "_total " in line:
            name, value = line.split(" ")
            out[name.removeprefix("sisrl_gateway_local_").removesuffix("_total")] = float(value)
    return out


def test_bearer_token(local_gateway: Any, gateway_token: str) -> None:
    url = local_gateway.url
    assert httpx.get(f"{url}/health").status_code == 200  # health is always open
    for path in ("/v1/rollouts", "/metrics", "/v1/runs/x/stats", "/v1/policy"):
        assert httpx.get(f"{url}{path}").status_code == 401
        assert httpx.get(f"{url}{path}", headers={"Authorization": "Bearer wrong-token-000"}).status_code == 401
        assert httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {gateway_token}"}).status_code == 200
    response = httpx.get(f"{url}/v1/rollouts", headers={"X-Request-ID": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123"


def test_policy_update(local_gateway: Any, tiny_policy_dir: Path, qa_subset: Any,
                       make_body: Callable[..., dict[str, Any]],
                       to_item: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    client = local_gateway.client
    outside = client.post("/v1/policy", json={"path": str(tiny_policy_dir), "version": 5})
    assert outside.status_code == 403 and "outside the checkpoint root" in outside.json()["detail"]
    assert client.post("/v1/policy", json={"path": "missing", "version": 5}).status_code == 404
    ckpt = local_gateway.root / "step5"
    shutil.copytree(tiny_policy_dir, ckpt)
    loaded = client.post("/v1/policy", json={"path": "step5", "version": 5}).raise_for_status().json()
    assert loaded == {"policy_version": 5, "path": str(ckpt.resolve())}
    assert client.get("/health").json()["policy_version"] == 5
    body = make_body([to_item(qa_subset.nq[0])], run="policy", max_turns=1)
    batch = local_gateway.wait_batch(client.post("/v1/rollouts", json=body).raise_for_status().json()["batch_id"])
    assert [t["policy_version"] for t in batch["trajectories"]] == [5]


def test_request_limits(local_gateway: Any, make_body: Callable[..., dict[str, Any]]) -> None:
    client = local_gateway.client
    items = [{"id": f"q{i}", "question": "x" * 4000, "golden_answers": ["a"], "data_source": "nq"} for i in range(20)]
    too_big = client.post("/v1/rollouts", json=make_body(items))
    assert too_big.status_code == 413 and "65536 bytes" in too_big.json()["detail"]
    long_question = [{"id": "q", "question": "x" * 5000, "golden_answers": ["a"], "data_source": "nq"}]
    assert client.post("/v1/rollouts", json=make_body(long_question)).status_code == 422
    assert client.post("/v1/rollouts", json=make_body([])).status_code == 422
    unknown = [{"id": "q", "question": "x", "golden_answers": ["a"], "data_source": "trivia"}]
    response = client.post("/v1/rollouts", json=make_body(unknown))
    assert response.status_code == 422 and "unknown data_source 'trivia'" in response.text
    duplicate = [{"id": "q", "question": "x", "golden_answers": ["a"], "data_source": "nq"}] * 2
    repeated = client.post("/v1/rollouts", json=make_body(duplicate))  # schema-valid, so a 400 (not a 422)
    assert repeated.status_code == 400 and "'q' repeats" in repeated.json()["detail"], repeated.text
    as_text = make_body([{"id": "q", "question": "x", "golden_answers": ["a"], "data_source": "nq"}], step="3")
    assert client.post("/v1/rollouts", json=as_text).status_code == 422  # strict: "3" is not an integer
