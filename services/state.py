"""Resources of one running gateway, built in the app lifespan (never at import).

A generating gateway holds a `Live` (engine, retriever client, batch runner; `services/live.py`). A store-only
one (`--store-only`) holds none: it serves the store and the viewer, and imports neither torch nor transformers.
It also leaves the batches table alone (no `running` -> `partial` marking), so it can run beside the live
gateway that writes the same store.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sisrl.services import store
from sisrl.services.metrics import GatewayMetrics
from sisrl.services.settings import GatewaySettings
from sisrl.services.texts import TokenTexts, load_texts
from sisrl.services.timing import BusyClock
from sqlalchemy.orm import Session, sessionmaker

if TYPE_CHECKING:
    from sisrl.services.engines.base import Engine
    from sisrl.services.retrieval_client import RetrievalClient
    from sisrl.services.runner import BatchRunner

log = logging.getLogger(__name__)


@dataclass
class Live:
    engine: Engine
    retriever: RetrievalClient
    runner: BatchRunner
    weights_dtype: str | None = None  # what the engine holds its weights in; None: unknown (vLLM's own `auto`)


@dataclass
class GatewayState:
    settings: GatewaySettings
    sessions: sessionmaker[Session]
    metrics: GatewayMetrics
    live: Live | None  # None: store-only
    texts: TokenTexts | None  # None: no tokenizer, the viewer shows ids
    policy_path: str | None = None
    submit_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    policy_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def is_running(self, batch_id: str) -> bool:
        return self.live is not None and self.live.runner.is_running(batch_id)

    @property
    def pending(self) -> int:
        return self.live.runner.pending if self.live is not None else 0


async def open_state(settings: GatewaySettings, *, clock: BusyClock, metrics: GatewayMetrics) -> GatewayState:
    sessions = store.open_db(settings.db_url)
    if settings.store_only:
        log.info("store-only: serving %s with no engine", store.display_url(settings.db_url))
        texts = load_texts(settings.tokenizer or settings.model)
        return GatewayState(settings=settings, sessions=sessions, metrics=metrics, live=None, texts=texts)
    from sisrl.services.live import open_live  # torch and transformers: only a generating gateway needs them

    try:
        live, texts = open_live(settings, sessions=sessions, clock=clock, metrics=metrics)
    except BaseException:
        store.dispose(sessions)
        raise
    await live.retriever.check()  # a warning names a retriever that refuses or does not answer
    return GatewayState(settings=settings, sessions=sessions, metrics=metrics, live=live, texts=texts)


async def close_state(state: GatewayState) -> None:
    if state.live is not None:
        from sisrl.services.live import close_live

        await close_live(state.live, state.sessions)
    store.dispose(state.sessions)
