"""The generating half of a gateway: tokenizer, engine, retriever client and batch runner (never store-only).

Imported only when the gateway generates, so `--store-only` starts without torch or transformers.
"""

from __future__ import annotations

import logging

from sisrl.common.models import load_tokenizer
from sisrl.services import store
from sisrl.services.agent import SearchR1Protocol
from sisrl.services.claims import open_claims
from sisrl.services.engines.base import Engine, create_engine
from sisrl.services.engines.local import LocalEngine
from sisrl.services.engines.pool import EnginePool
from sisrl.services.metrics import GatewayMetrics
from sisrl.services.retrieval_client import RetrievalClient, RetryPolicy
from sisrl.services.rewards import DEFAULT_SPECS, RewardSpec
from sisrl.services.runner import BatchRunner, RunnerDeps
from sisrl.services.scripted import ScriptedEngine, load_script
from sisrl.services.settings import GatewaySettings
from sisrl.services.state import Live
from sisrl.services.texts import TokenTexts, from_loaded
from sisrl.services.timing import BusyClock
from sqlalchemy.orm import Session, sessionmaker
from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def build_engine(settings: GatewaySettings, tokenizer: PreTrainedTokenizerBase) -> Engine:
    if settings.engine == "scripted":
        assert settings.script is not None, "validated in GatewaySettings"
        base = _real_engine(settings.script_base, settings, tokenizer) if settings.script_base else None
        return ScriptedEngine(tokenizer, load_script(settings.script), base=base)
    return _real_engine(settings.engine, settings, tokenizer)


def _real_engine(kind: str, settings: GatewaySettings, tokenizer: PreTrainedTokenizerBase) -> Engine:
    """The engine of `kind` ("local", "vllm-http" or "vllm") with every engine option of the settings."""
    if kind == "local":
        return create_engine("local", model=settings.model, tokenizer=tokenizer,
                             max_batch_size=settings.max_concurrency, dtype=settings.dtype,
                             prefix_cache_tokens=settings.prefix_cache_tokens)
    if kind == "vllm-http":
        key = settings.engine_api_key.get_secret_value() if settings.engine_api_key else None
        servers = [create_engine("vllm-http", model=settings.model, url=url, api_key=key,
                                 timeout_s=settings.engine_timeout_s, retries=settings.engine_retries,
                                 retry_budget_s=settings.engine_retry_budget_s,
                                 weights_route=settings.engine_weights_route,
                                 after_weights_routes=settings.after_weights_routes,
                                 max_connections=settings.max_concurrency)
                   for url in settings.engine_urls]
        if len(servers) == 1:
            return servers[0]
        return EnginePool(servers)  # type: ignore[arg-type]  # VLLMHttpEngine has `url`
    args: dict[str, object] = {"enforce_eager": settings.engine_enforce_eager}
    if settings.engine_max_model_len is not None:
        args["max_model_len"] = settings.engine_max_model_len
    if settings.dtype != "auto":  # auto: vLLM's own choice (the checkpoint's dtype)
        args["dtype"] = settings.dtype
    return create_engine("vllm", model=settings.model, **args)


def open_live(settings: GatewaySettings, *, sessions: sessionmaker[Session], clock: BusyClock,
              metrics: GatewayMetrics) -> tuple[Live, TokenTexts | None]:
    """Load the tokenizer and the engine, mark interrupted batches (SQLite), and build the runner.

    On SQLite this is the only generating gateway of its file, so every batch still `running` there was
    interrupted. On PostgreSQL other gateways may be running theirs: a batch counts as interrupted only while no
    process holds its claim (`claims`), and that is decided when it is read or resubmitted, not here."""
    name = settings.tokenizer or settings.model
    tokenizer = load_tokenizer(name)
    engine = build_engine(settings, tokenizer)
    claims = open_claims(sessions)
    if not claims.shared:
        with sessions() as session:
            interrupted = store.mark_interrupted(session=session)
        if interrupted:
            log.warning("%d batch(es) were interrupted by a previous stop; they report their missing items",
                        interrupted)
    metrics.policy_version.set(engine.policy_version)
    metrics.watch_engines(engine)
    retriever = RetrievalClient(
        settings.retriever_urls, topk=settings.topk, timeout_s=settings.retriever_timeout_s,
        retry=RetryPolicy(retries=settings.retriever_retries, backoff_s=settings.retriever_backoff_s),
        batch_size=settings.retriever_batch_size, window_s=settings.retriever_window_ms / 1000,
        on_request=metrics.record_retriever,
        token=settings.retriever_token.get_secret_value() if settings.retriever_token else None,
    )
    specs = {name: RewardSpec(metric=spec.metric, format_weight=settings.format_weight)
             for name, spec in DEFAULT_SPECS.items()}
    deps = RunnerDeps(
        engine=engine, searcher=retriever,
        protocol=SearchR1Protocol(tokenizer, observation_max_tokens=settings.observation_max_tokens),
        sessions=sessions, metrics=metrics, clock=clock, reward_specs=specs,
        max_response_tokens=settings.max_response_tokens, topk_logprobs_dtype=settings.topk_logprobs_dtype,
    )
    runner = BatchRunner(deps, max_concurrency=settings.max_concurrency, claims=claims)
    return (Live(engine=engine, retriever=retriever, runner=runner, weights_dtype=served_dtype(engine, settings)),
            from_loaded(tokenizer, name))


def served_dtype(engine: Engine, settings: GatewaySettings) -> str | None:
    """The dtype the engine holds its weights in (a trainer pushes in it: `model.push_dtype: auto`): the local
    engine's model's; otherwise the `--dtype` setting, None when that is `auto` (vLLM picks)."""
    if isinstance(engine, LocalEngine):
        return str(engine.model.dtype).removeprefix("torch.")
    return settings.dtype if settings.dtype != "auto" else None


async def close_live(live: Live, sessions: sessionmaker[Session]) -> None:
    """Stop running trajectories (this process's batches become `partial`, then lose its claim), then release
    the engine and the client. Batches other gateways run on the same store are left alone."""
    await live.runner.shutdown()
    with sessions() as session:
        store.mark_interrupted(session=session, batch_ids=live.runner.running_batches())
    live.runner.claims.close()
    await live.retriever.aclose()
    await live.engine.close()
