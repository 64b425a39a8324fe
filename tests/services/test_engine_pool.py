"""Several engine servers behind one gateway (services/engines/pool.py), on real policy-server processes.

Server A is the session's policy server, server B the session's second one (its own checkpoint root, so a
checkpoint can exist for one server and not the other; it requires a bearer token, A none). Checked: every turn
of a trajectory goes to one server and trajectories spread least-loaded; a SIGKILLed server's turns finish on the other with complete records; a
weight load reaches every server, and each generation carries the version its server reports
(`x-policy-version`); a server that cannot load is out until a probe reloads it; a restarted server rejoins
only with the current weights; and the gateway's settings build the pool and its per-server metrics.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest
from sisrl.common.models import build_tiny_policy, load_tokenizer
from sisrl.services.engines.base import Generation, SamplingParams
from sisrl.services.engines.pool import EnginePool
from sisrl.services.engines.vllm_http import VLLMHttpEngine
from sisrl.services.live import build_engine
from sisrl.services.metrics import GatewayMetrics
from sisrl.services.settings import GatewaySettings
from sisrl.services.timing import BusyClock

from tests.services.conftest import PolicyServer, SecondPolicyServer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0, logprobs_k=3, stop=())


@pytest.fixture(scope="module")
def server_b(policy_server_b: SecondPolicyServer) -> SecondPolicyServer:
    return policy_server_b


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = load_tokenizer()
    return [list(tokenizer.encode(f"Question {i}: who wrote book number {i}?")) for i in range(8)]


def pool_of(a: PolicyServer, b: SecondPolicyServer, **kwargs: Any) -> EnginePool:
    """A (no token) and B (requires its token): each engine sends its own key."""
    engines = [VLLMHttpEngine(a.url, model="", retries=0, timeout_s=60),
               VLLMHttpEngine(b.url, model="", retries=0, timeout_s=60, api_key=b.token)]
    return EnginePool(engines, **kwargs)  # type: ignore[arg-type]


def save_checkpoint(root: Path, name: str, seed: int) -> None:
    build_tiny_policy(load_tokenizer(), seed=seed).save_pretrained(root / name, safe_serialization=True)


async def trajectories(pool: EnginePool, prompts: list[list[int]], turns: int,
                       on_turn: Any = None) -> list[tuple[list[str], list[Generation]]]:
    """Each prompt as one trajectory of `turns` turns (context grows by what was sampled): servers and gens."""

    async def one(prompt: list[int]) -> tuple[list[str], list[Generation]]:
        view = pool.for_trajectory()
        context, servers, gens = list(prompt), [], []
        for turn in range(turns):
            gen = await view.generate(context, PARAMS)
            gen.validate(PARAMS.logprobs_k)
            assert view.server is not None
            servers.append(view.server.url)
            gens.append(gen)
            context += gen.token_ids
            if on_turn is not None:
                await on_turn(turn)
        return servers, gens

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def test_sticky_least_loaded_and_one_version_per_server(
        policy_server: PolicyServer, server_b: SecondPolicyServer, prompts: list[list[int]]) -> None:
    for root in (policy_server.checkpoint_root, server_b.root):
        save_checkpoint(root, "pool_v5", seed=5)
        save_checkpoint(root, "step0", seed=0)  # the session server goes back to its start-up weights

    async def body() -> None:
        pool = pool_of(policy_server, server_b)
        try:
            before = await trajectories(pool, prompts, turns=3)
            for servers, gens in before:
                assert len(set(servers)) == 1, f"a trajectory moved between servers: {servers}"
                assert {g.policy_version for g in gens} == {0}
            counts = {url: sum(s[0] == url for s, _ in before) for url in (policy_server.url, server_b.url)}
            assert counts == {policy_server.url: 4, server_b.url: 4}, counts  # 8 at once: least loaded
            await pool.load_weights("pool_v5", 5)
            assert pool.policy_version == 5 and [s.policy_version for s in pool.servers] == [5, 5]
            after = await trajectories(pool, prompts, turns=1)
            assert {url for servers, _ in after for url in servers} == {policy_server.url, server_b.url}
            assert {g.policy_version for _, gens in after for g in gens} == {5}  # from each server's header
            await pool.load_weights("step0", 0)
        finally:
            await pool.close()

    asyncio.run(body())


def test_a_server_that_cannot_load_is_out_until_a_probe_reloads_it(
        policy_server: PolicyServer, server_b: SecondPolicyServer, prompts: list[list[int]]) -> None:
    save_checkpoint(policy_server.checkpoint_root, "only_a", seed=3)
    shutil.rmtree(server_b.root / "only_a", ignore_errors=True)

    async def body() -> None:
        pool = pool_of(policy_server, server_b, down_s=0.5)
        try:
            await pool.load_weights("only_a", 3)  # B answers 404: A alone moves on
            a, b = pool.servers
            assert pool.policy_version == 3 and a.policy_version == 3 and b.policy_version == 0
            assert "404" in b.last_error
            out = await trajectories(pool, prompts, turns=1)
            assert {url for servers, _ in out for url in servers} == {policy_server.url}
            assert {g.policy_version for _, gens in out for g in gens} == {3}
            shutil.copytree(policy_server.checkpoint_root / "only_a", server_b.root / "only_a")
            await asyncio.sleep(0.6)
            await pool.generate(prompts[0], PARAMS)  # starts the probe, which reloads B
            for _ in range(200):
                if b.up:
                    break
                await asyncio.sleep(0.05)
            assert b.up and b.policy_version == 3, b
            back = await trajectories(pool, prompts, turns=1)
            assert {url for servers, _ in back for url in servers} == {policy_server.url, server_b.url}
            assert {g.policy_version for _, gens in back for g in gens} == {3}
            save_checkpoint(policy_server.checkpoint_root, "step0", seed=0)
            save_checkpoint(server_b.root, "step0", seed=0)
            await pool.load_weights("step0", 0)
        finally:
            await pool.close()

    asyncio.run(body())


def test_killed_server_fails_over_and_rejoins_with_the_current_weights(
        policy_server: PolicyServer, server_b: SecondPolicyServer, prompts: list[list[int]]) -> None:
    for root in (policy_server.checkpoint_root, server_b.root):
        save_checkpoint(root, "pool_v9", seed=9)
        save_checkpoint(root, "step0", seed=0)

    async def body() -> None:
        pool = pool_of(policy_server, server_b, down_s=0.5)
        killed = asyncio.Event()
        first_turns = 0

        async def kill_b_after_first_turn(turn: int) -> None:
            """Once every trajectory has its first turn (half of them on B), B dies; then they go on."""
            nonlocal first_turns
            if turn == 0:
                first_turns += 1
                if first_turns == len(prompts):
                    await asyncio.to_thread(server_b.kill)
                    killed.set()
                await killed.wait()

        try:
            out = await trajectories(pool, prompts, turns=3, on_turn=kill_b_after_first_turn)
            moved = [servers for servers, _ in out if servers[0] == server_b.url]
            assert len(moved) == len(prompts) // 2, out
            for _, gens in out:  # every turn of every trajectory has a complete record
                assert len(gens) == 3 and all(g.token_ids for g in gens)
            assert all(servers[-1] == policy_server.url for servers in moved), moved
            a, b = pool.servers
            assert not b.up and b.errors >= 1
            await pool.load_weights("pool_v9", 9)  # B is down: it must reload when it comes back
            assert pool.policy_version == 9 and a.policy_version == 9 and b.stale
            await asyncio.to_thread(server_b.start)  # a fresh process: its start-up weights, version 0
            await asyncio.sleep(1.0)
            for _ in range(200):
                await pool.generate(prompts[0], PARAMS)
                if b.up:
                    break
                await asyncio.sleep(0.05)
            assert b.up and b.policy_version == 9
            health = httpx.get(f"{server_b.url}/health", timeout=10).json()
            assert health["policy_version"] == 9, health  # the server itself reports the reloaded version
            back = await trajectories(pool, prompts, turns=1)
            assert {g.policy_version for _, gens in back for g in gens} == {9}
            await pool.load_weights("step0", 0)
        finally:
            await pool.close()

    asyncio.run(body())


def test_gateway_settings_make_a_pool_with_per_server_metrics(
        policy_server: PolicyServer, server_b: SecondPolicyServer, prompts: list[list[int]]) -> None:
    """`--engine-url A,B` builds a pool (what `sisrl-gateway serve` does in its lifespan), and the gateway's
    metrics registry (served as /metrics) has one series per server."""
    name = str(httpx.get(f"{policy_server.url}/v1/models").json()["data"][0]["id"])
    settings = GatewaySettings(engine="vllm-http", engine_url=f"{policy_server.url}, {server_b.url}/", model=name,
                               engine_retries=0, engine_api_key=server_b.token)  # A has no token: ignores it
    metrics = GatewayMetrics(BusyClock())

    async def body() -> None:
        engine = build_engine(settings, load_tokenizer(name))
        assert isinstance(engine, EnginePool)
        assert [s.url for s in engine.servers] == [policy_server.url, server_b.url]
        metrics.watch_engines(engine)
        try:
            await trajectories(engine, prompts, turns=2)
        finally:
            await engine.close()

    asyncio.run(body())
    text = generate_latest(metrics.registry).decode()
    routed = {}
    for line in text.splitlines():
        if line.startswith("sisrl_gateway_engine_trajectories_total{"):
            routed[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    assert routed == {policy_server.url: 4.0, server_b.url: 4.0}, text  # each trajectory routed once
    for family in ("in_flight", "up", "policy_version", "tokens_per_second", "requests_total", "errors_total",
                   "generated_tokens_total"):
        assert f'sisrl_gateway_engine_{family}{{server="{server_b.url}"}}' in text, family
    with pytest.raises(ValueError, match="engine URLs must be distinct"):
        GatewaySettings(engine="vllm-http", engine_url=f"{server_b.url},{server_b.url}")
