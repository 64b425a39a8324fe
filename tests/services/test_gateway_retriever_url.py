"""A wrong retriever URL made visible, through a real gateway (scripted policy) and the real retriever: a URL with a
wrong path is named with its status in a start-up warning, by the failed batch, and by the trainer's one-line
error. (The `/retrieve` endpoint given as the URL: tests/services/test_gateway_search.py.)"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from sisrl.trainer.config import RolloutConfig
from sisrl.trainer.data import QAItem
from sisrl.trainer.gateway_client import GatewayClient, GatewayError

from tests.services.conftest import Gateway

SCRIPT = {"rules": [{"match": "", "turns": ["<search>vampire diaries number of seasons</search>",
                                            "<answer>Eight</answer>"]}]}


def test_a_wrong_retriever_path_is_named_at_start_and_by_the_failed_batch(
        start_gateway: Callable[..., Gateway], retriever_url: str, tmp_path: Path) -> None:
    wrong = f"{retriever_url}/v1"  # a path the retriever does not serve: POST .../v1/retrieve answers 404
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))
    gateway = start_gateway("--engine", "scripted", "--script", str(script), "--retriever-url", wrong)
    assert f"retriever {wrong}/retrieve does not answer at start-up: HTTP 404" in gateway.log.read_text()
    client = GatewayClient(gateway.url)
    items = [QAItem(id=f"q{i}", question=f"question {i}", golden_answers=["x"], data_source="nq") for i in range(2)]
    batch_id = client.submit(run="wrong-path", step=0, policy_version=0, items=items, k=3, seed=0,
                             cfg=RolloutConfig(samples_per_prompt=2, max_turns=3, max_new_tokens=64))
    with pytest.raises(GatewayError) as info:
        client.wait(batch_id, timeout_s=60, poll_s=0.1)
    message = str(info.value)
    assert message.startswith(f"batch {batch_id} failed: all 4 trajectories ended with an error, the first: "
                              f"retriever: RetrievalError: retriever {wrong}/retrieve rejected the request: HTTP 404"), message
    batch = gateway.client.get(f"/v1/batches/{batch_id}").json()
    assert batch["status"] == "failed" and batch["error"] == batch["trajectories"][0]["error"]
    client.close()
