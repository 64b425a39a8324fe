"""`sisrl-gateway serve --store-only`: a real process on loopback over a store of real trajectories starts in
about a second without torch (no model load), serves stored rollouts and batches, answers 503 on the routes
that need an engine, and passes schemathesis (zero 5xx) with its bearer token."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from sisrl.common.procs import free_port, launch_module, wait_healthy
from sisrl.services.cli import build_parser, settings_from_args

from tests.conftest import run_schemathesis
from tests.services.conftest import rollout_body
from tests.services.viewer_data import ITEMS, RUN, SAMPLES, STEPS

# As in test_gateway_schema.py: a rule the schema cannot state is a listed 400.
ACCEPTS = ("400", "413")


@pytest.fixture(scope="module")
def started(viewer_store: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A store-only gateway with no token, timed from launch to its first healthy answer."""
    port = free_port()
    log = tmp_path_factory.mktemp("store_only") / "gateway.log"
    t0 = time.perf_counter()
    service = launch_module("gateway", "sisrl.services.cli",
                            ["serve", "--store-only", "--db-url", viewer_store.db_url, "--port", str(port),
                             "--log-level", "warning"], port=port, log=log, env={"SISRL_GATEWAY_API_TOKEN": None})
    wait_healthy(service, timeout_s=60)
    seconds = time.perf_counter() - t0
    print(f"store-only gateway healthy {seconds:.2f} s after launch")
    yield service, seconds
    service.stop()


def test_starts_without_loading_torch_or_a_model(started: Any) -> None:
    service, _seconds = started  # printed, not asserted: a shared CPU makes any bound flaky (README has figures)
    health = httpx.get(f"{service.url}/health").json()
    assert health == {"status": "ok", "policy_version": None, "engine": "store-only", "inflight_trajectories": 0,
                      "load_granularity": None, "store_only": True, "token_required": False,
                      "rollout": None, "weights_dtype": None}
    maps = Path(f"/proc/{service.process.pid}/maps")
    if sys.platform.startswith("linux") and maps.is_file():  # what the process mapped: no torch library, no model
        assert "libtorch" not in maps.read_text()


def test_generation_routes_answer_503_and_stored_data_is_served(started: Any, viewer_store: Any) -> None:
    url = started[0].url
    body = rollout_body([{"id": "x", "question": "q?", "golden_answers": ["a"], "data_source": "nq"}])
    for method, path, payload in (("POST", "/v1/rollouts", body), ("POST", "/v1/policy", {"path": "p", "version": 1}),
                                  ("GET", "/v1/policy", None)):
        resp = httpx.request(method, f"{url}{path}", json=payload)
        assert resp.status_code == 503 and "store-only" in resp.json()["detail"], (path, resp.text)
    batch = httpx.get(f"{url}/v1/batches/batch-1").json()
    assert (batch["status"], batch["progress"]) == ("done", {"done": len(ITEMS) * SAMPLES, "total": len(ITEMS) * SAMPLES})
    lines = httpx.get(f"{url}/v1/batches/batch-0/stream", timeout=10).text.splitlines()
    assert len(lines) == len(ITEMS) * SAMPLES  # the stream ends: nothing runs here
    page = httpx.get(f"{url}/v1/rollouts", params={"run": RUN, "searched": "false"}).json()
    assert page["count"] == sum(1 for t in viewer_store.trajectories if not t["turns"]) > 0
    assert {r["run"]: r["steps"] for r in httpx.get(f"{url}/v1/runs").json()["data"]} == {RUN: STEPS}
    searched = next(t for t in viewer_store.trajectories if t["turns"])
    texts = httpx.get(f"{url}/v1/rollouts/{searched['id']}/texts").json()
    assert texts["tokenizer"] == "smollm2-135m-instruct" and "Question:" in texts["prompt"]
    decoded = "".join(texts["pieces"][str(i)] for i in searched["response_ids"])
    assert "<information>Doc 1(Title:" in decoded and "</search>" in decoded


def test_store_only_needs_no_engine_options() -> None:
    parser = build_parser()
    settings = settings_from_args(parser.parse_args(["serve", "--store-only", "--engine", "vllm-http"]), parser)
    assert settings.store_only and settings.engine_url is None
    assert not settings_from_args(parser.parse_args(["serve", "--no-store-only"]), parser).store_only


def test_schemathesis_with_a_token(store_only_gateway: Any) -> None:
    schema = httpx.get(f"{store_only_gateway.url}/openapi.json").json()
    # the routes that need an engine answer 503 here, so this gateway's document leaves them out
    assert "post" not in schema["paths"]["/v1/rollouts"] and "/v1/policy" not in schema["paths"]
    assert {"404", "413", "422"} <= set(schema["paths"]["/v1/sis_records"]["post"]["responses"])
    run_schemathesis(f"{store_only_gateway.url}/openapi.json", token=store_only_gateway.token, examples=10,
                     also_accept=ACCEPTS, phases="examples,fuzzing")


def test_token_texts_come_from_tokenizer_json_alone_or_not_at_all(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    from sisrl.services.texts import load_texts, tokenizer_file

    assert load_texts(str(tmp_path)) is None and "the viewer shows token ids" in caplog.text  # no tokenizer.json
    source = tokenizer_file("smollm2-135m-instruct")  # converted by the session's viewer_template fixture
    assert source is not None
    (tmp_path / "tokenizer.json").write_bytes(source.read_bytes())
    texts = load_texts(str(tmp_path))
    assert texts is not None and texts.name == str(tmp_path)
    ids = texts.backend.encode("<search> Mira Tolk </search>").ids
    assert "".join(texts.pieces(ids)) == texts.text(ids) == "<search> Mira Tolk </search>"
    assert texts.pieces([ids[0], 10**9, -1]) == [texts.pieces([ids[0]])[0], "<id 1000000000>", "<id -1>"]
