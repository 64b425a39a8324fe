"""Engine over a vLLM OpenAI-compatible server (or sisrl's own `openai_server`), token-in / token-out over httpx.

Each `generate` is one `POST /v1/completions` with `prompt` as token ids, `logprobs=K`,
`return_tokens_as_token_ids=true` and `return_token_ids=true` (vLLM >= 0.10.2), stop strings kept
(`include_stop_str_in_output=true`) and every extra sampling knob disabled (`top_k=-1`, `min_p=0`,
`repetition_penalty=1`) so q is exactly temperature + top-p.

vLLM must run with `--logprobs-mode processed_logprobs`: by default it returns log-probs of the raw model
distribution, not of the distribution the token was sampled from, and SIS needs the latter. Also pass
`--max-logprobs K` when K > 20 and `--generation-config vllm` so the model's generation_config.json cannot
change the sampling defaults.

Top-K parsing (vLLM `serving_completion.py`): `top_logprobs[t]` maps `token_id:N` to a log-prob and holds the
sampled token plus the top-K, i.e. K + 1 entries when the sampled token ranks below K, K entries otherwise.
We drop the sampled token when it is the extra entry and order the rest by log-prob, giving exactly K by rank.

Weight updates: stock `vllm serve` has no load-from-disk route, so the route is configurable. The default,
`POST /v1/load_weights {"path", "version"}`, is sisrl's own server. For vLLM, run it with
`VLLM_SERVER_DEV_MODE=1 --worker-extension-cls sisrl.services.engines.vllm_worker.SafetensorsReload` and
use `weights_route="/collective_rpc"` (body `{"method": "sisrl_load_safetensors", "kwargs": {"path": ...}}`)
plus `after_weights_routes=("/reset_prefix_cache",)` so no KV computed with the old weights is reused.
A weight load is not retried once the server may have received it (a second load over a half-applied first
one hides the real error); only a connection that never opened is retried. An after-route that answers 200
with `{"success": false}` (vLLM's `/reset_prefix_cache` while blocks are still in use) is retried, then fails.

Retries are bounded twice: by `retries` and by `retry_budget_s`, the time one request may take over all its
attempts (no retry starts once the next wait would pass it). A busy server's `Retry-After` (429, 503) is waited out,
within that budget. A request that timed out is not retried at all: the server had it for the whole timeout and
may still be running it (sisrl's policy server cancels a generation when its connection closes; vLLM aborts it
too), so a second attempt would double the work that just proved too slow.

Connections: uvicorn answers an exception in the app with a 500 and then closes the socket without a
`Connection: close` header, so the pooled keep-alive connection would fail the next request with a
`ReadError`. After any 5xx the engine therefore moves to a fresh connection pool; the old one is closed as
soon as its in-flight requests finish.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

import httpx
from sisrl.services.engines.base import Generation, SamplingParams, check_prompt

log = logging.getLogger(__name__)
_TOKEN_PREFIX = "token_id:"
_RETRY_STATUS = frozenset({429, 502, 503, 504})


class VLLMHttpEngine:
    """`Engine` over HTTP. Safe for concurrent use (pooled httpx.AsyncClient, renewed after a 5xx)."""

    def __init__(
        self,
        url: str,
        *,
        model: str,
        policy_version: int = 0,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        retries: int = 3,
        weights_route: str = "/v1/load_weights",
        after_weights_routes: tuple[str, ...] = (),
        max_connections: int = 256,
        retry_budget_s: float = 120.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`url`: server base URL (`http://host:port`); `model`: the served model name ("" = server default).

        `retries`: further attempts of a generation (or an after-weights route) on transport errors, 429 and
        5xx; `retry_budget_s`: seconds one request may take over all its attempts (module docstring);
        `transport`: an httpx transport in place of the network (tests, proxies).
        """
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if retry_budget_s < 0:
            raise ValueError(f"retry_budget_s must be >= 0, got {retry_budget_s}")
        for route in (weights_route, *after_weights_routes):
            if not route.startswith("/"):
                raise ValueError(f"routes must start with '/', got {route!r}")
        self.url = url.rstrip("/")
        self.model = model
        self.policy_version = policy_version
        self.retries = retries
        self.retry_budget_s = retry_budget_s
        self.weights_route = weights_route
        self.after_weights_routes = tuple(after_weights_routes)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        timeout = httpx.Timeout(timeout_s, connect=10.0)

        def new_client() -> httpx.AsyncClient:
            return httpx.AsyncClient(
                base_url=self.url, headers=headers, timeout=timeout, limits=limits, transport=transport
            )

        self._new_client = new_client
        self._client = new_client()
        self._in_flight: dict[httpx.AsyncClient, int] = {}  # requests per client, old pools included

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """One completion. ValueError on a 4xx (bad request), RuntimeError when the server keeps failing."""
        check_prompt(prompt_ids)
        version = self.policy_version
        response = await self._post("/v1/completions", completion_body(self.model, prompt_ids, params))
        header = response.headers.get("x-policy-version")
        return parse_completion(response.json(), params.logprobs_k, int(header) if header else version)

    async def load_weights(self, path: str, version: int) -> None:
        """Ask the server to load `path` (a path on the server's machine), then record `version`.

        ValueError when the server refuses it (4xx), RuntimeError when it fails (5xx, a dropped connection,
        an after-route that reports no success); `policy_version` then stays as it was.
        """
        if self.weights_route == "/collective_rpc":
            body: dict[str, Any] = {"method": "sisrl_load_safetensors", "kwargs": {"path": path}}
        else:
            body = {"path": path, "version": version}
        await self._post(self.weights_route, body, idempotent=False)
        for route in self.after_weights_routes:
            await self._post(route, None, check_success=True)
        self.policy_version = version
        log.info("server %s loaded %s as policy version %d", self.url, path, version)

    async def close(self) -> None:
        for client in {self._client, *self._in_flight}:
            await client.aclose()
        self._in_flight.clear()

    async def _post(
        self, route: str, body: dict[str, Any] | None, *, idempotent: bool = True, check_success: bool = False
    ) -> httpx.Response:
        """POST with retries (exponential backoff + jitter) on transport errors, 429 and 5xx.

        `idempotent=False`: retry only when the connection never opened (the server cannot have seen it).
        `check_success`: a 2xx JSON body `{"success": false}` counts as a failure (vLLM's reset routes).
        """
        started = time.monotonic()
        for attempt in range(self.retries + 1):
            wait = 0.0  # a busy server's Retry-After
            try:
                response = await self._send(route, body)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                failure = f"{type(exc).__name__}: {exc}"
            except httpx.TimeoutException as exc:  # the server had it for the whole timeout: never run it twice
                raise RuntimeError(f"{self.url}{route} timed out after {time.monotonic() - started:.1f} s "
                                   f"({type(exc).__name__}); not retried, the server may still be running it "
                                   f"(setting engine_timeout_s)") from exc
            except httpx.TransportError as exc:
                failure = f"{type(exc).__name__}: {exc}"
                if not idempotent:
                    raise RuntimeError(f"{self.url}{route} failed (not retried): {failure}") from exc
            else:
                if response.status_code < 400:
                    if not check_success or _reports_success(response):
                        return response
                    failure = f"HTTP {response.status_code} without success: {response.text[:500]}"
                elif 400 <= response.status_code < 500 and response.status_code not in _RETRY_STATUS:
                    raise ValueError(
                        f"{self.url}{route} refused the request ({response.status_code}): {response.text}"
                    )
                else:
                    failure = f"HTTP {response.status_code}: {response.text[:500]}"
                    if not idempotent:
                        raise RuntimeError(f"{self.url}{route} failed (not retried): {failure}")
                    wait = _retry_after(response)
            if attempt < self.retries:
                delay = max(wait, min(8.0, 0.25 * 2**attempt) * (0.5 + random.random()))
                if time.monotonic() - started + delay > self.retry_budget_s:
                    raise RuntimeError(
                        f"{self.url}{route} failed after {attempt + 1} attempts in {time.monotonic() - started:.1f} "
                        f"s; another would pass the retry budget of {self.retry_budget_s:g} s (setting "
                        f"engine_retry_budget_s): {failure}")
                log.warning(
                    "%s%s failed (%s); retry %d in %.2fs", self.url, route, failure, attempt + 1, delay
                )
                await asyncio.sleep(delay)
        raise RuntimeError(f"{self.url}{route} failed after {self.retries + 1} attempts: {failure}")

    async def _send(self, route: str, body: dict[str, Any] | None) -> httpx.Response:
        """One POST on the current pool; a 5xx retires that pool (see the module docstring)."""
        client = self._client
        self._in_flight[client] = self._in_flight.get(client, 0) + 1
        try:
            response = await client.post(route, json=body)
            if response.status_code >= 500 and client is self._client:
                self._client = self._new_client()
            return response
        finally:
            self._in_flight[client] -= 1
            if client is not self._client and self._in_flight[client] == 0:
                del self._in_flight[client]
                await client.aclose()


def _retry_after(response: httpx.Response) -> float:
    """A 429 / 503's `Retry-After` in seconds (the delta-seconds form; an HTTP date or none: 0)."""
    value = response.headers.get("retry-after", "")
    try:
        return max(0.0, float(value))
    except ValueError:
        return 0.0


def _reports_success(response: httpx.Response) -> bool:
    """False only for a JSON object body whose `success` is false; empty and other bodies count as success."""
    try:
        data = response.json()
    except ValueError:
        return True
    return not (isinstance(data, dict) and data.get("success") is False)


def completion_body(model: str, prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
    """The `/v1/completions` request for one generation (vLLM field names)."""
    body: dict[str, Any] = {"model": model} if model else {}  # empty: the server's default model
    return body | {
        "prompt": prompt_ids,
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "logprobs": params.logprobs_k,
        "stop": list(params.stop),
        "seed": params.seed,
        "n": 1,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
    }


def parse_token(key: str) -> int:
    """`token_id:N` -> N (ValueError naming the key otherwise)."""
    if not key.startswith(_TOKEN_PREFIX) or not key[len(_TOKEN_PREFIX) :].isdigit():
        raise ValueError(f"expected a 'token_id:N' key (return_tokens_as_token_ids), got {key!r}")
    return int(key[len(_TOKEN_PREFIX) :])


def parse_topk(entries: dict[str, float], sampled: int, k: int) -> tuple[list[int], list[float]]:
    """Exactly K (id, log-prob) by rank from one vLLM `top_logprobs` dict (sampled token + top-K)."""
    pairs = [(parse_token(key), float(value)) for key, value in entries.items()]
    if len(pairs) > k:  # the sampled token is the extra entry: it ranks below K
        pairs = [(tid, lp) for tid, lp in pairs if tid != sampled]
    if len(pairs) != k:
        raise ValueError(f"expected {k} or {k + 1} top_logprobs entries, got {len(entries)}: {entries}")
    pairs.sort(key=lambda pair: -pair[1])  # stable: equal log-probs keep the server's rank order
    return [tid for tid, _ in pairs], [lp for _, lp in pairs]


def parse_completion(data: dict[str, Any], k: int, policy_version: int) -> Generation:
    """A vLLM completion response (one choice) -> Generation with [T] log-probs and [T][K] top-K."""
    try:
        choice = data["choices"][0]
        lp = choice["logprobs"]
        tokens = [parse_token(t) for t in lp["tokens"]]
        token_ids = [int(t) for t in choice.get("token_ids") or tokens]
        logprobs = [float(x) for x in lp["token_logprobs"]]
        top = lp["top_logprobs"]
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(
            f"not a vLLM completion with logprobs and token ids: {exc!r} in {str(data)[:500]}"
        ) from exc
    if tokens != token_ids or len(logprobs) != len(token_ids) or len(top) != len(token_ids):
        raise ValueError(
            f"inconsistent response: {len(token_ids)} token_ids, {len(tokens)} tokens, "
            f"{len(logprobs)} token_logprobs, {len(top)} top_logprobs"
        )
    topk = [parse_topk(entries, tok, k) for entries, tok in zip(top, token_ids, strict=True)]
    gen = Generation(
        token_ids=token_ids,
        logprobs=logprobs,
        topk_ids=[ids for ids, _ in topk],
        topk_logprobs=[lps for _, lps in topk],
        finish_reason=_finish_reason(choice),
        policy_version=policy_version,
    )
    gen.validate(k)
    return gen


def _finish_reason(choice: dict[str, Any]) -> str:
    """vLLM reports EOS and stop strings both as "stop"; `stop_reason` is the stop string, None at EOS."""
    reason, stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
    if reason == "length":
        return "length"
    if reason == "stop":
        return "stop" if isinstance(stop_reason, str) else "eos"
    raise RuntimeError(f"generation ended with finish_reason={reason!r} (stop_reason={stop_reason!r})")
