"""The OpenAI-compatible policy server (real uvicorn subprocess on 127.0.0.1) and the vLLM-HTTP engine pointed
at it: vLLM's wire format, equality with the local engine, weight reloads, errors, auth, and a bounded
schemathesis run with zero 5xx."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from sisrl.common.models import build_tiny_policy, load_tokenizer
from sisrl.common.procs import free_port
from sisrl.services.engines.base import MIN_LOGPROB, Generation, SamplingParams, create_engine
from sisrl.services.engines.local import LocalEngine
from sisrl.services.engines.openai_server import ServerSettings, create_app
from sisrl.services.engines.vllm_http import VLLMHttpEngine, parse_completion, parse_topk
from sisrl.services.engines.vllm_inproc import from_ranked_logprobs
from transformers import LlamaForCausalLM

from tests.conftest import run_schemathesis

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QUESTIONS = [
    "Who wrote Dracula?",
    "Capital of Australia, briefly:",
    "<search>tallest mountain</search> then",
    "Hi",
]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = load_tokenizer()
    return [list(tokenizer.encode(q)) for q in QUESTIONS]


def http_engine(server: Any, **kwargs: Any) -> VLLMHttpEngine:
    """The vLLM-HTTP engine on the policy server, naming the model the server reports."""
    name = str(httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"])
    engine = create_engine("vllm-http", model=name, url=server.url, retries=0, **kwargs)
    assert isinstance(engine, VLLMHttpEngine)
    return engine


def test_completion_speaks_vllm_wire_format(policy_server: Any, prompts: list[list[int]]) -> None:
    k = 3
    body = {
        "prompt": prompts[0],
        "max_tokens": 12,
        "temperature": 1.0,
        "logprobs": k,
        "seed": 4,
        "stop": ["</answer>"],
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
    }
    response = httpx.post(f"{policy_server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["x-policy-version"] == "0"
    data = response.json()
    assert data["object"] == "text_completion"
    choice = data["choices"][0]
    ids = choice["token_ids"]
    assert choice["prompt_token_ids"] == prompts[0]
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None and len(ids) == 12
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 12
    sizes = set()
    for token, logprob, top in zip(ids, lp["token_logprobs"], lp["top_logprobs"], strict=True):
        first_key, first_value = next(iter(top.items()))
        assert (first_key, first_value) == (f"token_id:{token}", logprob)  # the sampled token comes first
        assert len(top) == (k if sum(v > logprob for v in top.values()) < k else k + 1)
        sizes.add(len(top))
    assert data["usage"] == {
        "prompt_tokens": len(prompts[0]),
        "completion_tokens": 12,
        "total_tokens": len(prompts[0]) + 12,
    }
    assert sizes == {k + 1}, "a random tiny model samples outside its top-3 nearly always"


def test_parse_topk_keeps_exactly_k_by_rank() -> None:
    # Sampled token 7 outside the top-2: three entries, sampled first (vLLM's order).
    assert parse_topk({"token_id:7": -5.0, "token_id:3": -0.5, "token_id:9": -1.0}, 7, 2) == (
        [3, 9],
        [-0.5, -1.0],
    )
    # Sampled token 9 inside the top-2: two entries, sampled first, re-ordered by rank.
    assert parse_topk({"token_id:9": -1.0, "token_id:3": -0.5}, 9, 2) == ([3, 9], [-0.5, -1.0])
    with pytest.raises(ValueError, match="expected 2 or 3"):
        parse_topk({"token_id:9": -1.0}, 9, 2)
    with pytest.raises(ValueError, match="'tok9'"):
        parse_topk({"tok9": -1.0, "token_id:3": -0.5}, 9, 2)


def test_parse_completion_maps_vllm_finish_reasons() -> None:
    def response(finish: str, stop_reason: str | int | None) -> dict[str, Any]:
        lp = {"tokens": ["token_id:4"], "token_logprobs": [-0.5], "top_logprobs": [{"token_id:4": -0.5}]}
        return {
            "choices": [
                {"finish_reason": finish, "stop_reason": stop_reason, "token_ids": [4], "logprobs": lp}
            ]
        }

    assert parse_completion(response("stop", None), 1, 0).finish_reason == "eos"  # vLLM's EOS: no stop_reason
    assert parse_completion(response("stop", 4), 1, 0).finish_reason == "eos"  # a stop token id
    assert parse_completion(response("stop", "</answer>"), 1, 0).finish_reason == "stop"
    assert parse_completion(response("length", None), 1, 0).finish_reason == "length"
    with pytest.raises(RuntimeError, match="abort"):
        parse_completion(response("abort", None), 1, 0)
    broken = response("length", None)
    broken["choices"][0]["token_ids"] = [5]
    with pytest.raises(ValueError, match="inconsistent"):
        parse_completion(broken, 1, 0)


def test_vllm_http_engine_equals_local_engine(
    policy_server: Any, tiny_policy_dir: Path, prompts: list[list[int]]
) -> None:
    """Same weights, same seeds: the HTTP engine (through the server) returns the local engine's generation."""
    tokenizer = load_tokenizer()
    base = SamplingParams(max_new_tokens=12, temperature=0.0, stop=())
    free = asyncio.run(_generate_local(tiny_policy_dir, [prompts[2]], [base]))[0]
    stop = tokenizer.decode(free.token_ids[4:6])  # ends the greedy request early, through the HTTP stop path
    params = [
        SamplingParams(max_new_tokens=12, temperature=1.0, seed=1, logprobs_k=5),
        SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, seed=2, logprobs_k=5),
        SamplingParams(max_new_tokens=12, temperature=0.0, stop=("</answer>", stop), logprobs_k=5),
        SamplingParams(max_new_tokens=10, temperature=1.3, seed=3, logprobs_k=0),
    ]
    local = asyncio.run(_generate_local(tiny_policy_dir, prompts, params))

    async def remote() -> list[Generation]:
        engine = http_engine(policy_server)
        try:
            return await asyncio.gather(
                *[engine.generate(p, s) for p, s in zip(prompts, params, strict=True)]
            )
        finally:
            await engine.close()

    over_http = asyncio.run(remote())
    assert over_http[2].finish_reason == "stop"
    for a, b in zip(local, over_http, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and a.topk_ids == b.topk_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-5
        flat = [
            (x - y)
            for xs, ys in zip(a.topk_logprobs, b.topk_logprobs, strict=True)
            for x, y in zip(xs, ys, strict=True)
        ]
        assert max(map(abs, flat), default=0.0) <= 1e-5


async def _generate_local(
    model: Path | LlamaForCausalLM, prompts: list[list[int]], params: list[SamplingParams]
) -> list[Generation]:
    engine = (
        LocalEngine(str(model), dtype="float32") if isinstance(model, Path)
        else LocalEngine(model, tokenizer=load_tokenizer())
    )
    try:
        return await asyncio.gather(*[engine.generate(p, s) for p, s in zip(prompts, params, strict=True)])
    finally:
        await engine.close()


def test_weight_reload_through_the_server(
    policy_server: Any, tiny_policy_dir: Path, prompts: list[list[int]]
) -> None:
    tokenizer = load_tokenizer()
    root = policy_server.checkpoint_root
    build_tiny_policy(tokenizer, seed=1).save_pretrained(root / "step1", safe_serialization=True)
    params = SamplingParams(max_new_tokens=8, seed=5, logprobs_k=2, stop=())

    async def body() -> tuple[Generation, Generation]:
        engine = http_engine(policy_server)
        try:
            before = await engine.generate(prompts[1], params)
            await engine.load_weights("step1", 7)
            after = await engine.generate(prompts[1], params)
            with pytest.raises(ValueError, match="outside the checkpoint root"):
                await engine.load_weights("../elsewhere", 8)
            with pytest.raises(ValueError, match="404"):
                await engine.load_weights("missing", 8)
            return before, after
        finally:
            # Put the session's server back on the original weights (version 0).
            build_tiny_policy(tokenizer, seed=0).save_pretrained(root / "step0", safe_serialization=True)
            await engine.load_weights("step0", 0)
            await engine.close()

    before, after = asyncio.run(body())
    assert (before.policy_version, after.policy_version) == (0, 7)
    assert before.token_ids != after.token_ids
    fresh = build_tiny_policy(tokenizer, seed=1)
    reference = asyncio.run(_generate_local(fresh, [prompts[1]], [params]))[0]
    assert reference.token_ids == after.token_ids


def test_bad_requests_are_client_errors(policy_server: Any, prompts: list[list[int]]) -> None:
    url = f"{policy_server.url}/v1/completions"
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"prompt": [1, 10**6]}, 400, "prompt_ids[1] = 1000000"),
        ({"prompt": prompts[0], "logprobs": 21}, 400, "logprobs=21"),
        ({"prompt": prompts[0], "max_tokens": 17}, 400, "max_tokens=17"),
        ({"prompt": prompts[0], "model": "gpt-x"}, 404, "gpt-x"),
        ({"prompt": prompts[0], "temperature": -1}, 422, "temperature"),
        ({"prompt": prompts[0], "top_k": 5}, 422, "top_k"),
        ({"prompt": []}, 422, "prompt"),
        # Strict JSON types: `true` is not the integer 1 (nor 0 `false`), "2" not 2.
        ({"prompt": prompts[0], "logprobs": True}, 422, "logprobs"),
        ({"prompt": prompts[0], "n": True}, 422, "expected an integer, got a boolean"),
        ({"prompt": prompts[0], "stream": 0}, 422, "expected a boolean"),
        ({"prompt": prompts[0], "max_tokens": "2"}, 422, "max_tokens"),
        ({"prompt": [True]}, 422, "prompt"),
    ]
    for body, status, fragment in cases:
        response = httpx.post(url, json=body, timeout=30)
        assert response.status_code == status and fragment in response.text, (body, response.text)

    async def via_engine() -> None:
        engine = http_engine(policy_server)
        try:
            with pytest.raises(ValueError, match="400"):
                await engine.generate([1, 10**6], SamplingParams(max_new_tokens=2))
        finally:
            await engine.close()

    asyncio.run(via_engine())


def test_vllm_inproc_is_optional_and_keeps_k_by_rank() -> None:
    with pytest.raises(ImportError, match="needs the vllm package"):
        create_engine("vllm", model="smollm2-135m-instruct")

    @dataclass
    class Ranked:  # the two fields of vLLM's Logprob that the converter reads
        logprob: float
        rank: int

    # Position 0: sampled token 5 ranks 4th (outside K = 2); position 1: sampled token 8 ranks 1st.
    positions = [
        {5: Ranked(-3.0, 4), 1: Ranked(-0.2, 1), 2: Ranked(-1.9, 2)},
        {8: Ranked(-0.1, 1), 3: Ranked(-float("inf"), 2)},
    ]
    gen = from_ranked_logprobs([5, 8], positions, 2, "eos", 4)
    assert gen.logprobs == [-3.0, -0.1]
    assert gen.topk_ids == [[1, 2], [8, 3]] and gen.topk_logprobs == [[-0.2, -1.9], [-0.1, MIN_LOGPROB]]
    with pytest.raises(ValueError, match="expected 3 entries"):
        from_ranked_logprobs([5, 8], positions, 3, "eos", 4)


def test_dead_server_is_a_runtime_error(prompts: list[list[int]]) -> None:
    async def body() -> None:
        engine = VLLMHttpEngine("http://127.0.0.1:9", model="m", retries=1)
        try:
            with pytest.raises(RuntimeError, match="after 2 attempts"):
                await engine.generate(prompts[0], SamplingParams(max_new_tokens=2))
        finally:
            await engine.close()

    asyncio.run(body())


def test_bearer_token_guards_all_but_health(tiny_policy_dir: Path, prompts: list[list[int]]) -> None:
    async def body() -> None:
        engine = LocalEngine(str(tiny_policy_dir))
        settings = ServerSettings(model=str(tiny_policy_dir), api_token=SecretStr("s3cret-s3cret-16"), max_body_bytes=1024)
        app = create_app(settings, engine=engine)
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                assert (await client.get("/health")).status_code == 200
                refused = await client.get("/v1/models")
                assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
                too_big = await client.post("/v1/completions", content=b"x" * 1025, headers={"Authorization": "Bearer s3cret-s3cret-16"})
                assert too_big.status_code == 413 and "max_body_bytes" in too_big.json()["detail"]
                good = {"Authorization": "Bearer s3cret-s3cret-16"}
                assert (
                    await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
                ).status_code == 401
                ok = await client.post(
                    "/v1/completions", json={"prompt": prompts[3], "max_tokens": 2}, headers=good
                )
                assert ok.status_code == 200 and ok.json()["choices"][0]["logprobs"] is None
                assert "sisrl_engine_requests" in (await client.get("/metrics", headers=good)).text
        finally:
            await engine.close()

    asyncio.run(body())


# A schema-valid request the engine cannot serve is a 400 that each route lists: a prompt longer than the model's
# positions, token ids beyond its vocabulary, a checkpoint that does not load. positive_data_acceptance allows
# 400 (never 422: a schema-valid body must pass validation); the server's own caps (max_tokens, logprobs) are in
# the served schema, so those are never generated.
POLICY_ACCEPTS = ("400",)


def test_schemathesis_all_checks_on_the_policy_server(policy_server: Any) -> None:
    """`schemathesis run --checks all` over the live server as it starts by default (no token): zero failures."""
    schema = httpx.get(f"{policy_server.url}/openapi.json").json()
    assert {"/v1/completions", "/v1/load_weights"} <= set(schema["paths"])
    assert not any("security" in op for item in schema["paths"].values() for op in item.values())
    run_schemathesis(f"{policy_server.url}/openapi.json", examples=10, phases="examples,fuzzing", seed=2,
                     also_accept=POLICY_ACCEPTS)


def test_schemathesis_all_checks_on_the_policy_server_with_a_token(policy_server_b: Any) -> None:
    """The same with a bearer token set: security on every route but /health, 401 listed, zero failures."""
    schema = httpx.get(f"{policy_server_b.url}/openapi.json").json()
    assert schema["paths"]["/v1/completions"]["post"]["security"]
    assert "security" not in schema["paths"]["/health"]["get"]
    run_schemathesis(f"{policy_server_b.url}/openapi.json", token=policy_server_b.token, examples=10,
                     phases="examples,fuzzing", seed=2, also_accept=POLICY_ACCEPTS)


# --- failure handling of the vLLM-HTTP engine: a scripted transport stands in for the failing server ---------


def _completion_json(token: int = 4) -> dict[str, Any]:
    lp = {"tokens": [f"token_id:{token}"], "token_logprobs": [-0.5], "top_logprobs": [{f"token_id:{token}": -0.5}]}
    return {"choices": [{"finish_reason": "length", "stop_reason": None, "token_ids": [token], "logprobs": lp}]}


class _SlowErrorLog(logging.Handler):
    """Holds uvicorn's event loop while it logs an app exception, i.e. after the 500 went out and before uvicorn
    closes the socket: the client's next request then lands on a connection the server is about to drop."""

    def emit(self, record: logging.LogRecord) -> None:
        time.sleep(0.5)


def test_a_500_that_drops_the_connection_does_not_fail_the_next_request() -> None:
    """uvicorn answers an exception with a 500 and closes the socket without `Connection: close` (vLLM's server
    does this); with retries=0 the next request must still succeed, on a fresh connection."""
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()
    calls: list[int] = []

    @app.post("/v1/completions")
    def completions() -> dict[str, Any]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("engine step failed")
        return _completion_json()

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, log_level="error",
                                           access_log=False))
    handler = _SlowErrorLog()
    logging.getLogger("uvicorn.error").addHandler(handler)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)

        async def body() -> Generation:
            engine = VLLMHttpEngine(f"http://127.0.0.1:{port}", model="", retries=0)
            params = SamplingParams(max_new_tokens=1, logprobs_k=1, stop=())
            try:
                with pytest.raises(RuntimeError, match="HTTP 500"):
                    await engine.generate([1, 2], params)
                return await engine.generate([1, 2], params)
            finally:
                await engine.close()

        assert asyncio.run(body()).token_ids == [4]
        assert len(calls) == 2
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        logging.getLogger("uvicorn.error").removeHandler(handler)


def _scripted(responses: list[httpx.Response | Exception], seen: list[str]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        answer = responses.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return httpx.MockTransport(handle)


def test_a_failing_weight_load_is_not_retried() -> None:
    async def load(responses: list[httpx.Response | Exception]) -> tuple[list[str], BaseException | None, int]:
        seen: list[str] = []
        engine = VLLMHttpEngine("http://vllm", model="m", retries=3, weights_route="/collective_rpc",
                                after_weights_routes=("/reset_prefix_cache",), transport=_scripted(responses, seen))
        error: BaseException | None = None
        try:
            await engine.load_weights("/ckpt/v1", 1)
        except (RuntimeError, ValueError) as exc:
            error = exc
        finally:
            await engine.close()
        return seen, error, engine.policy_version

    # A 500 from the worker (a checkpoint that failed to load): one attempt, RuntimeError, version kept.
    seen, error, version = asyncio.run(load([httpx.Response(500, text="worker raised")]))
    assert seen == ["/collective_rpc"] and isinstance(error, RuntimeError) and "not retried" in str(error)
    assert version == 0
    # A connection dropped after the request went out: the server may be loading; not retried either.
    request = httpx.Request("POST", "http://vllm/collective_rpc")
    seen, error, _ = asyncio.run(load([httpx.ReadError("reset", request=request)]))
    assert seen == ["/collective_rpc"] and isinstance(error, RuntimeError)
    # A connection that never opened is safe to retry.
    seen, error, version = asyncio.run(load([httpx.ConnectError("refused", request=request),
                                             httpx.Response(200, json={"results": [291]}),
                                             httpx.Response(200, json={"success": True})]))
    assert seen == ["/collective_rpc", "/collective_rpc", "/reset_prefix_cache"] and error is None and version == 1


def test_a_prefix_cache_reset_without_success_fails_the_load() -> None:
    async def load(reset: list[httpx.Response]) -> tuple[list[str], BaseException | None, int]:
        seen: list[str] = []
        transport = _scripted([httpx.Response(200, json={"results": [291]}), *reset], seen)
        engine = VLLMHttpEngine("http://vllm", model="m", retries=1, weights_route="/collective_rpc",
                                after_weights_routes=("/reset_prefix_cache",), transport=transport)
        error: BaseException | None = None
        try:
            await engine.load_weights("/ckpt/v1", 1)
        except RuntimeError as exc:
            error = exc
        finally:
            await engine.close()
        return seen, error, engine.policy_version

    # vLLM answers 200 {"success": false} while blocks are in use: retried (it is idempotent), then an error.
    seen, error, version = asyncio.run(load([httpx.Response(200, json={"success": False})] * 2))
    assert seen == ["/collective_rpc"] + ["/reset_prefix_cache"] * 2 and version == 0
    assert isinstance(error, RuntimeError) and "without success" in str(error)
    # Success on the retry, and an empty 200 body (older servers) counts as success.
    seen, error, version = asyncio.run(load([httpx.Response(200, json={"success": False}), httpx.Response(200)]))
    assert error is None and version == 1 and len(seen) == 3


def test_gateway_settings_reach_the_vllm_http_engine() -> None:
    from sisrl.services.live import build_engine
    from sisrl.services.settings import GatewaySettings

    settings = GatewaySettings(engine="vllm-http", engine_url="http://127.0.0.1:8000", model="served",
                               engine_weights_route="/collective_rpc", engine_retries=0,
                               engine_after_weights_routes="/reset_prefix_cache, /other",
                               engine_api_key=SecretStr("k3y-k3y-k3y"), engine_timeout_s=5)
    engine = build_engine(settings, load_tokenizer())
    assert isinstance(engine, VLLMHttpEngine)
    assert (engine.url, engine.model, engine.weights_route, engine.after_weights_routes, engine.retries) == (
        "http://127.0.0.1:8000", "served", "/collective_rpc", ("/reset_prefix_cache", "/other"), 0)
    assert engine._client.headers["authorization"] == "Bearer k3y-k3y-k3y"
    asyncio.run(engine.close())
    with pytest.raises(ValueError, match="starting with '/'"):
        GatewaySettings(engine="vllm-http", engine_url="http://x", engine_after_weights_routes="reset")


@pytest.mark.parametrize(("argv", "message"), [
    (["--port", "70000"], "error: port must be <= 65535, got 70000"),
    (["--model", "/no/such/policy"], "error: model: no such directory '/no/such/policy'"),
    (["--max-batch-size", "0"], "error: max_batch_size must be >= 1, got 0"),
])
def test_policy_server_bad_options_are_one_line(argv: list[str], message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from sisrl.services.engines.openai_server import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err
