"""The trainer's gateway client under failure: retries of transport errors, 429 (after its Retry-After) and 5xx;
one error line naming the gateway and the last error once the budget is spent; a partial batch resumed by its
idempotency key; errored trajectories kept out of the update. A scripted HTTP server on 127.0.0.1 plays the
failing gateway (failure handling only: the real gateway's resume is tests/trainer/test_gateway_restart.py)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from sisrl.trainer.batch import collate
from sisrl.trainer.data import MixtureSampler, QAItem
from sisrl.trainer.gateway_client import (
    GatewayClient,
    GatewayError,
    GatewaySource,
    RetryPolicy,
    retry_after_s,
)
from sisrl.trainer.pipeline import RolloutPipeline
from sisrl.trainer.policy import build_optimizer, build_scheduler, load_policy
from sisrl.trainer.sampling import SyntheticSource
from sisrl.trainer.update import Updater, train_on_batch

from tests.trainer.helpers import synthetic_config

Reply = tuple[int, dict[str, str], Any]  # status, headers, JSON body


class ScriptedGateway:
    """Answers each request with the next reply scripted for its (method, path); the last one repeats.
    Records (method, path, monotonic time) of every request."""

    def __init__(self) -> None:
        self.script: dict[tuple[str, str], list[Reply]] = {}
        self.seen: list[tuple[str, str, float]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                outer.seen.append((self.command, self.path, time.monotonic()))
                replies = outer.script.get((self.command, self.path)) or [(404, {}, {"detail": "not scripted"})]
                status, headers, body = replies.pop(0) if len(replies) > 1 else replies[0]
                raw = json.dumps(body).encode()
                self.send_response(status)
                for key, value in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def count(self, method: str, path: str) -> int:
        return sum(1 for m, p, _ in self.seen if (m, p) == (method, path))


@pytest.fixture
def gateway() -> Iterator[ScriptedGateway]:
    server = ScriptedGateway()
    yield server
    server.server.shutdown()
    server.server.server_close()


FAST = RetryPolicy(budget_s=5.0, first_s=0.05, max_s=0.2)


def test_429_waits_its_retry_after_then_succeeds(gateway: ScriptedGateway) -> None:
    gateway.script[("GET", "/health")] = [(429, {"Retry-After": "1"}, {"detail": "full"}),
                                          (200, {}, {"status": "ok", "policy_version": 3})]
    client = GatewayClient(gateway.url, retry=FAST)  # its own backoff would retry after 0.05 s at most
    assert client.health()["policy_version"] == 3
    (_, _, first), (_, _, second) = gateway.seen
    assert 1.0 <= second - first < 1.8


def test_retry_after_reads_seconds_and_http_dates() -> None:
    assert retry_after_s("2") == 2.0 and retry_after_s("0.5") == 0.5 and retry_after_s("-3") == 0.0
    in_10_s = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 10))
    assert 8.0 < (retry_after_s(in_10_s) or 0.0) <= 10.0
    assert retry_after_s(None) is None and retry_after_s("soon") is None


def test_5xx_and_transport_errors_are_retried_4xx_is_not(gateway: ScriptedGateway) -> None:
    gateway.script[("POST", "/v1/rollouts")] = [(503, {}, {"detail": "restarting"}), (502, {}, "bad gateway"),
                                                (500, {}, "boom"), (200, {}, {"batch_id": "b1", "status": "running"})]
    client = GatewayClient(gateway.url, retry=FAST)
    assert client.submit_body({"idempotency_key": "k"}) == "b1"
    assert gateway.count("POST", "/v1/rollouts") == 4

    gateway.script[("POST", "/v1/policy")] = [(409, {}, {"detail": "min_policy_version"})]
    with pytest.raises(GatewayError, match=r"POST http://127\.0\.0\.1:\d+/v1/policy: HTTP 409"):
        client.push_policy(Path("/x"), 1)
    assert gateway.count("POST", "/v1/policy") == 1


def test_a_spent_budget_is_one_line_naming_the_gateway_and_the_last_error(gateway: ScriptedGateway) -> None:
    gateway.script[("GET", "/v1/batches/b1")] = [(503, {}, {"detail": "engine\nrestarting"})]
    client = GatewayClient(gateway.url, retry=RetryPolicy(budget_s=0.6, first_s=0.05, max_s=0.1))
    started = time.monotonic()
    with pytest.raises(GatewayError) as caught:
        client.wait("b1", timeout_s=60, poll_s=0.01)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"gateway {gateway.url} did not answer GET /v1/batches/b1 ")
    assert message.endswith('last error: HTTP 503: {"detail": "engine\\nrestarting"}')
    assert 0.4 <= time.monotonic() - started < 1.0 and gateway.count("GET", "/v1/batches/b1") >= 4

    gateway.server.shutdown()
    gateway.server.server_close()  # nothing listens there now: connection refused
    with pytest.raises(GatewayError, match=rf"^gateway {gateway.url} did not answer GET /health .*last error: Connect"):
        client.health()
    with pytest.raises(GatewayError, match="after 1 attempts"):  # budget 0: no retry
        GatewayClient(gateway.url, retry=RetryPolicy(budget_s=0)).health()


def _batch(status: str, done: int, trajectories: list[dict[str, Any]] | None = None) -> Reply:
    return (200, {}, {"batch_id": "b1", "status": status, "progress": {"done": done, "total": 4},
                      "missing_items": [] if status == "done" else ["q1"], "trajectories": trajectories,
                      "error": None})


def test_a_partial_batch_is_resumed_by_its_key_after_the_newest_policy_is_pushed_again(
        gateway: ScriptedGateway) -> None:
    body = {"idempotency_key": "run:0", "items": []}
    gateway.script[("GET", "/v1/batches/b1")] = [_batch("running", 1), _batch("partial", 1), _batch("running", 2),
                                                 _batch("done", 4, [])]
    gateway.script[("POST", "/v1/rollouts")] = [(200, {}, {"batch_id": "b1", "status": "running"})]
    gateway.script[("POST", "/v1/policy")] = [(200, {}, {"policy_version": 2, "path": "/ckpt/v2"})]
    gateway.script[("GET", "/health")] = [(200, {}, {"status": "ok", "policy_version": 0})]  # restarted
    client = GatewayClient(gateway.url, retry=FAST)
    client.push_policy(Path("/ckpt/v2"), 2)
    assert client.wait("b1", timeout_s=30, poll_s=0.01, body=body) == []
    calls = [(m, p) for m, p, _ in gateway.seen]
    assert calls == [("POST", "/v1/policy"), ("GET", "/v1/batches/b1"), ("GET", "/v1/batches/b1"),
                     ("GET", "/health"), ("POST", "/v1/policy"), ("POST", "/v1/rollouts"),
                     ("GET", "/v1/batches/b1"), ("GET", "/v1/batches/b1")]

    # without its body, or when resubmitting stores nothing new, a partial batch ends the wait
    gateway.script[("GET", "/v1/batches/b1")] = [_batch("partial", 1)]
    with pytest.raises(GatewayError, match=r"batch b1 partial: its gateway stopped with 1 of 4 trajectories"):
        client.wait("b1", timeout_s=30, poll_s=0.01)
    with pytest.raises(GatewayError, match=r"partial: .*; resubmitted 3 times in a row without a new trajectory$"):
        client.wait("b1", timeout_s=30, poll_s=0.01, body=body)


def test_a_restarted_gateway_refusing_the_runs_version_gets_the_policy_again(gateway: ScriptedGateway) -> None:
    """Killed after a push and restarted before the next submit, a gateway serves its --model weights (version 0)
    and refuses a batch that needs the run's version (409): the client pushes that version again and resubmits."""
    refused = (409, {}, {"detail": "min_policy_version 2: the engine serves policy 0"})
    gateway.script[("POST", "/v1/rollouts")] = [refused, (200, {}, {"batch_id": "b1", "status": "running"})]
    gateway.script[("POST", "/v1/policy")] = [(200, {}, {"policy_version": 2, "path": "/ckpt/v2"})]
    gateway.script[("GET", "/health")] = [(200, {}, {"status": "ok", "policy_version": 0})]
    client = GatewayClient(gateway.url, retry=FAST)
    client.push_policy(Path("/ckpt/v2"), 2)
    assert client.submit_body({"idempotency_key": "run:2", "min_policy_version": 2}) == "b1"
    assert [(m, p) for m, p, _ in gateway.seen] == [("POST", "/v1/policy"), ("POST", "/v1/rollouts"),
                                                   ("GET", "/health"), ("POST", "/v1/policy"),
                                                   ("POST", "/v1/rollouts")]
    gateway.script[("POST", "/v1/rollouts")] = [(409, {}, {"detail": "idempotency key reused with another body"})]
    with pytest.raises(GatewayError, match="HTTP 409"):  # any other conflict is not retried
        client.submit_body({"idempotency_key": "run:2"})


def _pipeline(gateway: ScriptedGateway, cfg: Any, trajectories: list[dict[str, Any]],
              monkeypatch: pytest.MonkeyPatch) -> RolloutPipeline:
    """A pipeline whose one batch is `trajectories`, served done by the scripted gateway in the JSON form (the
    trainer reads Arrow pages, whose equality to the JSON form tests/services/test_batch_arrow.py checks)."""
    monkeypatch.setattr(GatewayClient, "wait_arrow", GatewayClient.wait)
    gateway.script[("POST", "/v1/rollouts")] = [(200, {}, {"batch_id": "b1", "status": "running"})]
    gateway.script[("GET", "/v1/batches/b1")] = [_batch("done", len(trajectories), trajectories)]
    items = [QAItem(id="q0", question="?", golden_answers=["a"], data_source="nq")]
    source = GatewaySource(GatewayClient(gateway.url, retry=FAST), cfg.rollout, run="run", k=8, seed=0)
    return RolloutPipeline.for_run(source, MixtureSampler([items], [1.0], seed=0), cfg.rollout, total_steps=4,
                                   resumed=False)


def test_a_trajectory_of_another_policy_version_is_dropped_and_counted(gateway: ScriptedGateway, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = synthetic_config(tmp_path)
    one = {"id": "t", "item_id": "q0", "group_id": "g", "data_source": "nq", "prompt_ids": [1], "response_ids": [2],
           "loss_mask": [1], "behaviour_logprobs": [-0.1], "topk_ids": [[2]], "topk_logprobs": [[-0.1]],
           "reward": 1.0, "policy_version": 0}
    batch = [{**one, "id": f"t{v}", "policy_version": v} for v in (0, 1, 2)]
    taken = _pipeline(gateway, cfg, batch, monkeypatch).take(0, 1)  # sync (k = 0): the trainer expects version 1 only
    assert ([t.id for t in taken.trajectories], taken.dropped, taken.errored) == (["t1"], 2, 0)


def test_an_errored_trajectory_does_not_change_the_update(gateway: ScriptedGateway, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch the gateway returns holds an extra errored trajectory with the best reward of its group; the
    update from what the pipeline takes equals the update without it (and differs from one trained on it)."""
    torch.set_num_threads(1)
    cfg = synthetic_config(tmp_path, rollout={"prompts_per_step": 2, "samples_per_prompt": 4},
                           algorithm={"staleness": 1})
    model, tok = load_policy(cfg.model, seed=0, device=torch.device("cpu"))
    clean = SyntheticSource(model, cfg.rollout, k=8, seed=0, vocab_size=len(tok)).rollouts([], 0, 0)
    broken = replace(clean[0], id="0-err", reward=1.0, error="retriever: RetrievalError: HTTP 503")
    taken = _pipeline(gateway, cfg, [t.to_json() for t in [*clean[:4], broken, *clean[4:]]], monkeypatch).take(0, 0)
    assert (taken.errored, taken.dropped, [t.id for t in taken.trajectories]) == (1, 0, [t.id for t in clean])

    def weights_after(trajs: list[Any]) -> list[torch.Tensor]:
        policy, _ = load_policy(cfg.model, seed=0, device=torch.device("cpu"))
        opt = build_optimizer(policy, cfg.optim)
        u = Updater(model=policy, optimizer=opt, scheduler=build_scheduler(opt, cfg.optim, 1), algo=cfg.algorithm,
                    optim=cfg.optim, temperature=1.0)
        train_on_batch(u, collate(trajs, pad_id=int(tok.pad_token_id), k=8), torch.Generator().manual_seed(0))
        return [p.detach().clone() for p in policy.parameters()]

    taken_w, clean_w = weights_after(taken.trajectories), weights_after(clean)
    assert all(torch.equal(a, b) for a, b in zip(taken_w, clean_w, strict=True))
    with_error = weights_after([*clean, broken])  # what training on it would do: the test can fail
    assert max(float((a - b).abs().max()) for a, b in zip(with_error, clean_w, strict=True)) > 1e-4
