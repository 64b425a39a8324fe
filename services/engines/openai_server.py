"""A small OpenAI-completions-compatible server over the local engine (a CPU policy server, vLLM's wire format).

    python -m sisrl.services.engines.openai_server --model smollm2-135m-instruct --port 8001

Routes: `POST /v1/completions` (prompt as token ids, `logprobs=K`, `return_tokens_as_token_ids`,
`return_token_ids`, stop strings, seed), `POST /v1/load_weights` (safetensors dir under `--checkpoint-root`),
`GET /v1/models`, `GET /health`, `GET /metrics`. Each completion response carries `X-Policy-Version`.
Set `SISRL_ENGINE_API_TOKEN` to require `Authorization: Bearer <token>` on every route but `/health`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import SecretStr
from sisrl.common.http import RequestMetrics, ServiceMiddleware, bearer_dependency, configure_logging
from sisrl.common.wire import ENGINE_PORT
from sisrl.services.engines.base import Generation, SamplingParams
from sisrl.services.engines.local import LocalEngine
from sisrl.services.engines.openai_schemas import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Health,
    LoadWeightsRequest,
    LoadWeightsResponse,
    ModelCard,
    ModelList,
    Usage,
)
from transformers import PreTrainedTokenizerBase

TOKEN_ENV = "SISRL_ENGINE_API_TOKEN"


@dataclass(frozen=True)
class ServerSettings:
    """Every option of the server; each field is one CLI flag (`--max-batch-size`, ...)."""

    model: str = field(default="smollm2-135m-instruct", metadata={"help": "policy name or HF directory"})
    served_model_name: str | None = field(
        default=None, metadata={"help": "model name in responses; unset means the --model value"}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "bind address"})
    port: int = field(default=ENGINE_PORT, metadata={"help": "bind port"})
    max_batch_size: int = field(default=32, metadata={"help": "most sequences decoded together"})
    max_logprobs: int = field(default=20, metadata={"help": "largest `logprobs` (K) a request may ask for"})
    max_tokens: int = field(default=4096, metadata={"help": "largest `max_tokens` a request may ask for"})
    checkpoint_root: str | None = field(
        default=None,
        metadata={"help": "weights may be loaded only from under this folder (unset: loading off)"},
    )
    dtype: str = field(default="auto", metadata={"help": "model dtype: auto (bfloat16 only where native), "
                                                 "float32, bfloat16 or float16"})
    threads: int = field(
        default=0, metadata={"help": "torch CPU threads (0: torch's default; 1 on a busy machine)"}
    )
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error"})
    max_body_bytes: int = field(default=8 * 2**20, metadata={"help": "request body limit in bytes (413 beyond)"})
    api_token: SecretStr | None = field(
        default=None, metadata={"help": f"bearer token (CLI: env {TOKEN_ENV} only)"}
    )

    def __post_init__(self) -> None:
        for name in ("port", "max_batch_size", "max_logprobs", "max_tokens", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = torch's default), got {self.threads}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.http = RequestMetrics(self.registry, requests="sisrl_engine_requests", latency="sisrl_engine_request_seconds")
        self.tokens = Counter("sisrl_engine_generated_tokens", "Generated tokens", registry=self.registry)


def create_app(settings: ServerSettings, engine: LocalEngine | None = None) -> FastAPI:
    """The server app. The engine loads in the lifespan unless one is given (then the caller owns it)."""
    metrics = _Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine is not None:  # given by the caller, who also closes it
            yield
            return
        app.state.engine = await asyncio.to_thread(
            LocalEngine,
            settings.model,
            max_batch_size=settings.max_batch_size,
            dtype=settings.dtype,
            num_threads=settings.threads or None,
        )
        yield
        await app.state.engine.close()

    app = FastAPI(title="sisrl OpenAI-compatible policy server", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.engine = engine

    app.add_middleware(ServiceMiddleware, metrics=metrics.http, max_body=settings.max_body_bytes,
                       limit_setting="max_body_bytes", access_log=logging.getLogger("sisrl.services.engines.access"))
    app.include_router(_health_router())
    app.include_router(_api_router(), dependencies=[Depends(bearer_dependency(lambda r: _settings(r).api_token))])
    return app


def _engine(request: Request) -> LocalEngine:
    engine: LocalEngine = request.app.state.engine
    return engine


def _settings(request: Request) -> ServerSettings:
    settings: ServerSettings = request.app.state.settings
    return settings


EngineDep = Annotated[LocalEngine, Depends(_engine)]
SettingsDep = Annotated[ServerSettings, Depends(_settings)]


def _health_router() -> APIRouter:
    router = APIRouter(tags=["health"])

    @router.get("/health", response_model=Health)
    async def health(engine: EngineDep, settings: SettingsDep) -> Health:
        return Health(model=_served_name(settings), policy_version=engine.policy_version)

    return router


def _api_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions", response_model=CompletionResponse, tags=["completions"])
    async def completions(
        body: CompletionRequest,
        engine: EngineDep,
        settings: SettingsDep,
        request: Request,
        response: Response,
    ) -> CompletionResponse:
        prompt, params = _to_engine_request(body, engine.tokenizer, settings)
        try:
            gen = await engine.generate(prompt, params)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        request.app.state.metrics.tokens.inc(len(gen.token_ids))
        response.headers["x-policy-version"] = str(gen.policy_version)
        choice = _choice(body, prompt, gen, engine.tokenizer)
        usage = Usage(
            prompt_tokens=len(prompt),
            completion_tokens=len(gen.token_ids),
            total_tokens=len(prompt) + len(gen.token_ids),
        )
        return CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=_served_name(settings),
            choices=[choice],
            usage=usage,
        )

    @router.post("/v1/load_weights", response_model=LoadWeightsResponse, tags=["weights"])
    async def load_weights(
        body: LoadWeightsRequest, engine: EngineDep, settings: SettingsDep
    ) -> LoadWeightsResponse:
        path = _checked_weights_path(body.path, settings)
        try:
            await engine.load_weights(str(path), body.version)
        except FileNotFoundError as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from exc
        except (ValueError, OSError) as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        return LoadWeightsResponse(policy_version=engine.policy_version)

    @router.get("/v1/models", response_model=ModelList, tags=["models"])
    async def models(settings: SettingsDep) -> ModelList:
        return ModelList(data=[ModelCard(id=_served_name(settings))])

    @router.get("/metrics", tags=["metrics"], response_class=Response)
    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return router


def _served_name(settings: ServerSettings) -> str:
    return settings.served_model_name or settings.model


def _to_engine_request(
    body: CompletionRequest, tokenizer: PreTrainedTokenizerBase, settings: ServerSettings
) -> tuple[list[int], SamplingParams]:
    """Validate against the server limits and map to engine inputs (HTTP 400 naming the bad field)."""
    if body.model is not None and body.model != _served_name(settings):
        raise HTTPException(
            status_code=404, detail=f"model {body.model!r} is not served; use {_served_name(settings)!r}"
        )
    if body.max_tokens > settings.max_tokens:
        raise HTTPException(
            status_code=400, detail=f"max_tokens={body.max_tokens} exceeds {settings.max_tokens}"
        )
    if body.logprobs is not None and body.logprobs > settings.max_logprobs:
        raise HTTPException(
            status_code=400, detail=f"logprobs={body.logprobs} exceeds {settings.max_logprobs}"
        )
    prompt = _tokenize(tokenizer, body.prompt) if isinstance(body.prompt, str) else body.prompt
    try:
        params = SamplingParams(
            max_new_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            logprobs_k=body.logprobs or 0,
            stop=body.stop_strings(),
            seed=body.seed,
        )
    except ValueError as exc:
        raise HTTPException(status_code=400, detail=str(exc)) from exc
    return prompt, params


def _tokenize(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise HTTPException(status_code=400, detail=f"prompt is not valid Unicode text: {exc}") from exc
    return list(tokenizer.encode(text))


def _choice(
    body: CompletionRequest, prompt: list[int], gen: Generation, tokenizer: PreTrainedTokenizerBase
) -> CompletionChoice:
    """One vLLM-style choice: text cut at the stop string, finish "stop" for EOS and stops, stop_reason."""
    text = str(tokenizer.decode(gen.token_ids, skip_special_tokens=body.skip_special_tokens))
    stop_reason: str | None = None
    if gen.finish_reason == "stop":
        found = [(text.find(s), s) for s in body.stop_strings() if s in text]
        if found:
            at, stop_reason = min(found)
            text = text[: at + len(stop_reason)] if body.include_stop_str_in_output else text[:at]
    return CompletionChoice(
        index=0,
        text=text,
        logprobs=_logprobs(gen, tokenizer, body.return_tokens_as_token_ids)
        if body.logprobs is not None
        else None,
        finish_reason="length" if gen.finish_reason == "length" else "stop",
        stop_reason=stop_reason,
        token_ids=gen.token_ids if body.return_token_ids else None,
        prompt_token_ids=prompt if body.return_token_ids else None,
    )


def _logprobs(gen: Generation, tokenizer: PreTrainedTokenizerBase, as_ids: bool) -> CompletionLogprobs:
    """Per token: its text (or `token_id:N`), log q, and {sampled, then top-K by rank} as vLLM orders them."""

    def name(token: int) -> str:
        return f"token_id:{token}" if as_ids else str(tokenizer.decode([token]))

    tokens = [name(t) for t in gen.token_ids]
    top: list[dict[str, float] | None] = []
    for token, logprob, ids, lps in zip(
        gen.token_ids, gen.logprobs, gen.topk_ids, gen.topk_logprobs, strict=True
    ):
        entry = {name(token): logprob}
        for tid, lp in zip(ids, lps, strict=True):
            entry.setdefault(name(tid), lp)
        top.append(entry)
    offsets, at = [], 0
    for token_text in tokens:
        offsets.append(at)
        at += len(token_text)
    return CompletionLogprobs(
        text_offset=offsets, token_logprobs=list(gen.logprobs), tokens=tokens, top_logprobs=top
    )


def _checked_weights_path(given: str, settings: ServerSettings) -> Path:
    """The resolved path, or 403 when loading is off or the path escapes the checkpoint root."""
    if settings.checkpoint_root is None:
        raise HTTPException(
            status_code=403, detail="weight loading is off; start the server with --checkpoint-root"
        )
    if "\x00" in given:
        raise HTTPException(status_code=400, detail="path contains a NUL character")
    root = Path(settings.checkpoint_root).resolve()
    try:
        path = (root / given).resolve()
    except (OSError, RuntimeError) as exc:  # e.g. a name too long, a symlink loop
        raise HTTPException(status_code=400, detail=f"bad path {given!r}: {exc}") from exc
    if not path.is_relative_to(root):
        raise HTTPException(
            status_code=403, detail=f"path {given!r} is outside the checkpoint root {str(root)!r}"
        )
    return path


def parse_args(argv: list[str] | None = None) -> ServerSettings:
    """CLI flags from the ServerSettings fields (`--help` lists each with its default)."""
    parser = argparse.ArgumentParser(
        prog="python -m sisrl.services.engines.openai_server",
        description="OpenAI-completions-compatible policy server over the local transformers engine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in dataclasses.fields(ServerSettings):
        if f.name == "api_token":
            continue
        kind = int if f.type in ("int", int) else str
        parser.add_argument(
            f"--{f.name.replace('_', '-')}", type=kind, default=f.default, help=f.metadata["help"]
        )
    args = vars(parser.parse_args(argv))
    try:
        token = os.environ.get(TOKEN_ENV)
        return ServerSettings(**args, api_token=SecretStr(token) if token else None)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv)
    configure_logging(settings.log_level)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_config=None,
                log_level=settings.log_level)


__all__ = ["ServerSettings", "create_app", "main", "parse_args"]

if __name__ == "__main__":
    main()
