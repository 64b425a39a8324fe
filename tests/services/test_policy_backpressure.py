"""Bounded work in the policy server (`python -m sisrl.services.engines.openai_server`, a real process on loopback
over the tiny policy): with one completion in flight and no queue, a second is answered 429 with Retry-After; a
client that goes away cancels its generation, which leaves the engine's batch long before it would have finished."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sisrl.common.procs import Service, free_port, launch_module, wait_healthy
from sisrl.services.engines.base import SamplingParams
from sisrl.services.engines.openai_server import parse_args
from sisrl.services.engines.vllm_http import VLLMHttpEngine

from tests.services.conftest import STARTUP_S

MAX_TOKENS = 2000  # tens of seconds of decoding for the tiny policy on one thread; the client leaves after 1.5 s


@pytest.fixture(scope="module")
def one_slot_server(tiny_policy_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    log = tmp_path_factory.mktemp("one_slot_policy_server") / "server.log"
    port = free_port()
    service = launch_module("policy server", "sisrl.services.engines.openai_server",
                            ["--model", str(tiny_policy_dir), "--port", str(port), "--max-tokens", str(MAX_TOKENS),
                             "--max-in-flight", "1", "--max-queued", "0", "--log-level", "warning", "--threads", "1",
                             "--dtype", "float32"],
                            port=port, log=log, env={"SISRL_ENGINE_API_TOKEN": None})
    wait_healthy(service, timeout_s=STARTUP_S)
    yield service
    service.stop()


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found, f"no metric {name} in /metrics"
    return float(found.group(1))


def wait_metric(url: str, name: str, value: float, timeout_s: float) -> float:
    """Seconds until metric `name` reads `value` (fails after `timeout_s`)."""
    started = time.monotonic()
    while (seen := metric(url, name)) != value:
        assert time.monotonic() - started < timeout_s, f"{name} = {seen} after {timeout_s} s, expected {value}"
        time.sleep(0.05)
    return time.monotonic() - started


def completion(max_tokens: int) -> dict[str, object]:
    return {"prompt": [1, 2, 3, 4], "max_tokens": max_tokens, "temperature": 1.0, "logprobs": 1, "seed": 11,
            "return_tokens_as_token_ids": True, "return_token_ids": True}


def test_a_second_completion_past_the_cap_gets_429_and_a_gone_client_cancels_its_generation(
        one_slot_server: Service) -> None:
    url = one_slot_server.url
    left: list[float] = []

    def impatient() -> None:
        try:
            httpx.post(f"{url}/v1/completions", json=completion(MAX_TOKENS), timeout=1.5)
        except httpx.TimeoutException:
            left.append(time.monotonic())  # the client closes the connection here

    client = threading.Thread(target=impatient)
    client.start()
    wait_metric(url, "sisrl_engine_in_flight", 1, timeout_s=10)
    refused = httpx.post(f"{url}/v1/completions", json=completion(4), timeout=10)
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["retry-after"]) >= 1
    assert "(settings max_in_flight, max_queued)" in refused.json()["detail"]

    client.join(30)
    assert left, "the long generation finished before its client left: raise MAX_TOKENS"
    # Cancelled: out of the gate and out of the engine's batch within a couple of decode steps of the disconnect.
    assert wait_metric(url, "sisrl_engine_in_flight", 0, timeout_s=5) < 5
    wait_metric(url, "sisrl_engine_sequences", 0, timeout_s=5)
    sampled = metric(url, "sisrl_engine_sampled_tokens")
    time.sleep(0.5)
    assert metric(url, "sisrl_engine_sampled_tokens") == sampled, "the engine still decodes for nobody"
    assert 0 < sampled < MAX_TOKENS
    assert metric(url, 'sisrl_engine_cancelled_total{reason="disconnect"}') == 1
    assert metric(url, 'sisrl_engine_rejected_total{reason="full"}') == 1
    assert "local engine step failed" not in one_slot_server.log.read_text()  # the row left quietly

    answered = httpx.post(f"{url}/v1/completions", json=completion(4), timeout=30)  # the place was freed
    assert answered.status_code == 200 and len(answered.json()["choices"][0]["token_ids"]) <= 4


def test_the_http_engine_never_retries_a_timed_out_generation_and_keeps_to_its_retry_budget(
        one_slot_server: Service) -> None:
    url = one_slot_server.url
    cancelled = metric(url, 'sisrl_engine_cancelled_total{reason="disconnect"}')
    long = SamplingParams(max_new_tokens=MAX_TOKENS, temperature=1.0, logprobs_k=1, stop=(), seed=11)
    short = SamplingParams(max_new_tokens=4, temperature=1.0, logprobs_k=1, stop=(), seed=11)

    async def run() -> tuple[str, str, float]:
        engine = VLLMHttpEngine(url, model="", timeout_s=1.5, retries=3, retry_budget_s=0.5)
        try:
            holder = asyncio.create_task(engine.generate([1, 2, 3, 4], long))
            await asyncio.to_thread(wait_metric, url, "sisrl_engine_in_flight", 1, 10)
            # 429 with Retry-After >= 1 s: waiting it out would pass the 0.5 s budget, so no retry starts.
            with pytest.raises(RuntimeError) as busy:
                await engine.generate([1, 2, 3, 4], short)
            started = time.monotonic()
            with pytest.raises(RuntimeError) as timed_out:
                await holder
            return str(busy.value), str(timed_out.value), time.monotonic() - started
        finally:
            await engine.close()

    busy, timed_out, waited = asyncio.run(run())
    assert "failed after 1 attempts" in busy and "retry budget of 0.5 s (setting engine_retry_budget_s)" in busy
    assert "HTTP 429" in busy
    assert "timed out after" in timed_out and "not retried" in timed_out, timed_out
    assert waited < 1.5  # one attempt of 1.5 s in all, begun before; four would take 6 s
    # The server saw the connection close and cancelled the generation.
    wait_metric(url, "sisrl_engine_in_flight", 0, timeout_s=5)
    assert metric(url, 'sisrl_engine_cancelled_total{reason="disconnect"}') == cancelled + 1


@pytest.mark.parametrize(("env", "problem"), [
    ({"SISRL_ENGINE_API_TOKEN": "short-token"}, "SISRL_ENGINE_API_TOKEN: expected at least 16 characters, got 11"),
    ({"SISRL_ENGINE_API_TOKEN": "engine-token-0123456789", "SISRL_ENGINE_API_TOKEN_FILE": "/x"}, "not both"),
    ({"SISRL_ENGINE_API_TOKEN_FILE": "/nonexistent/token"}, "SISRL_ENGINE_API_TOKEN_FILE: cannot read"),
])
def test_the_policy_server_token_comes_from_its_env_or_file_and_has_16_characters(
        env: dict[str, str], problem: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SISRL_ENGINE_API_TOKEN", raising=False)
    monkeypatch.delenv("SISRL_ENGINE_API_TOKEN_FILE", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit):
        parse_args(["--port", str(free_port())])
    error = capsys.readouterr().err
    assert problem in error and "short-token" not in error and "0123456789" not in error


def test_the_policy_server_reads_its_token_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SISRL_ENGINE_API_TOKEN", raising=False)
    (tmp_path / "token").write_text("engine-token-0123456789\n")
    monkeypatch.setenv("SISRL_ENGINE_API_TOKEN_FILE", str(tmp_path / "token"))
    settings = parse_args(["--port", str(free_port())])
    assert settings.api_token is not None and settings.api_token.get_secret_value() == "engine-token-0123456789"
