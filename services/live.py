"""The generating half of a gateway: tokenizer, engine, retriever client and batch runner (never store-only).

Imported only when the gateway generates, so `--store-only` starts without torch or transformers.
"""

from __future__ import annotations

import logging

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
from sisrl.services.state import Live
from sisrl.services.texts import TokenTexts, from_loaded
from sisrl.services.timing import BusyClock
from sqlalchemy.orm import Session, sessionmaker
from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def build_engine(settings: GatewaySettings, tokenizer: PreTrainedTokenizerBase) -> Engine:
    if settings.engine == "scripted":
        assert settings.script is not None, "validated in GatewaySettings"
        return ScriptedEngine(tokenizer, load_script(settings.script))
    if settings.engine == "local":
        return create_engine("local", model=settings.model, tokenizer=tokenizer,
                             max_batch_size=settings.max_concurrency, dtype=settings.dtype)
    return create_engine(settings.engine, model=settings.model, url=settings.engine_url)


def open_live(settings: GatewaySettings, *, sessions: sessionmaker[Session], clock: BusyClock,
              metrics: GatewayMetrics) -> tuple[Live, TokenTexts | None]:
    """Load the tokenizer and the engine, mark interrupted batches, and build the runner."""
    name = settings.tokenizer or settings.model
    tokenizer = load_tokenizer(name)
    engine = build_engine(settings, tokenizer)
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
    return Live(engine=engine, retriever=retriever, runner=runner), from_loaded(tokenizer, name)


async def close_live(live: Live, sessions: sessionmaker[Session]) -> None:
    """Stop running trajectories (their batches become `partial`), then release the engine and the client."""
    await live.runner.shutdown()
    with sessions() as session:
        store.mark_interrupted(session=session)
    await live.retriever.aclose()
    await live.engine.close()
