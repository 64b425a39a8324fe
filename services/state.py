"""Resources of one running gateway, built in the app lifespan (never at import)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from sisrl.common.models import load_tokenizer
from sisrl.services import store
from sisrl.services.agent import SearchR1Protocol
from sisrl.services.engines.base import Engine, create_engine
from sisrl.services.metrics import GatewayMetrics
from sisrl.services.retrieval_client import RetrievalClient, RetryPolicy
from sisrl.services.rewards import DEFAULT_SPECS, RewardSpec
from sisrl.services.runner import BatchRunner, RunnerDeps
from sisrl.services.scripted import ScriptedEngine, load_script
from sisrl.services.settings import GatewaySettings
from sisrl.services.timing import BusyClock
from sqlalchemy.orm import Session, sessionmaker
from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass
class GatewayState:
    settings: GatewaySettings
    engine: Engine
    retriever: RetrievalClient
    sessions: sessionmaker[Session]
    runner: BatchRunner
    metrics: GatewayMetrics
    policy_path: str | None = None
    submit_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    policy_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def build_engine(settings: GatewaySettings, tokenizer: PreTrainedTokenizerBase) -> Engine:
    if settings.engine == "scripted":
        assert settings.script is not None, "validated in GatewaySettings"
        return ScriptedEngine(tokenizer, load_script(settings.script))
    if settings.engine == "local":
        return create_engine("local", model=settings.model, tokenizer=tokenizer,
                             max_batch_size=settings.max_concurrency, dtype=settings.dtype)
    return create_engine(settings.engine, model=settings.model, url=settings.engine_url)


async def open_state(settings: GatewaySettings, *, clock: BusyClock, metrics: GatewayMetrics) -> GatewayState:
    tokenizer = load_tokenizer(settings.tokenizer or settings.model)
    engine = build_engine(settings, tokenizer)
    sessions = store.open_db(settings.db_url)
    with sessions() as session:
        interrupted = store.mark_interrupted(session=session)
    if interrupted:
        log.warning("%d batch(es) were interrupted by a previous stop; they report their missing items", interrupted)
    metrics.policy_version.set(engine.policy_version)
    retriever = RetrievalClient(
        settings.retriever_url, topk=settings.topk, timeout_s=settings.retriever_timeout_s,
        retry=RetryPolicy(retries=settings.retriever_retries, backoff_s=settings.retriever_backoff_s),
        batch_size=settings.retriever_batch_size, window_s=settings.retriever_window_ms / 1000,
        on_request=metrics.record_retriever,
    )
    specs = {name: RewardSpec(metric=spec.metric, format_weight=settings.format_weight)
             for name, spec in DEFAULT_SPECS.items()}
    deps = RunnerDeps(
        engine=engine, searcher=retriever,
        protocol=SearchR1Protocol(tokenizer, observation_max_tokens=settings.observation_max_tokens),
        sessions=sessions, metrics=metrics, clock=clock, reward_specs=specs,
        max_response_tokens=settings.max_response_tokens,
    )
    runner = BatchRunner(deps, max_concurrency=settings.max_concurrency)
    return GatewayState(settings=settings, engine=engine, retriever=retriever, sessions=sessions, runner=runner,
                        metrics=metrics)


async def close_state(state: GatewayState) -> None:
    """Stop running trajectories (their batches become `partial`), then release everything."""
    await state.runner.shutdown()
    with state.sessions() as session:
        store.mark_interrupted(session=session)
    await state.retriever.aclose()
    await state.engine.close()
    store.dispose(state.sessions)
