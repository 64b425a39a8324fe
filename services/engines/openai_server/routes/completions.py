"""`POST /v1/completions` in vLLM's wire format: token ids in, sampled ids and the behaviour log-probs out."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, HTTPException, Request, Response
from sisrl.services.engines.base import Generation, SamplingParams
from sisrl.services.engines.openai_server.deps import AdmissionDep, EngineDep, MetricsDep, SettingsDep
from sisrl.services.engines.openai_server.schemas import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from sisrl.services.engines.openai_server.settings import ServerSettings
from transformers import PreTrainedTokenizerBase

router = APIRouter(prefix="/v1/completions", tags=["completions"])


@router.post("", response_model=CompletionResponse,
             responses={400: {"description": "a request the engine cannot serve (e.g. max_tokens above the cap)"},
                        404: {"description": "`model` names a model this server does not serve"},
                        429: {"description": "busy: max_in_flight completions run and max_queued wait (Retry-After)"},
                        503: {"description": "past the deadline, request_timeout_s: cancelled (Retry-After)"}})
async def completions(body: CompletionRequest, request: Request, engine: EngineDep, settings: SettingsDep,
                      metrics: MetricsDep, admission: AdmissionDep, response: Response) -> CompletionResponse:
    """One generation. It is cancelled (its row leaves the engine's batch) when the client goes away or the
    deadline passes (sisrl.common.admission)."""
    prompt, params = _to_engine_request(body, engine.tokenizer, settings)
    try:
        gen = await admission.run(request, engine.generate(prompt, params))
    except ValueError as exc:
        raise HTTPException(status_code=400, detail=str(exc)) from exc
    metrics.tokens.inc(len(gen.token_ids))
    response.headers["x-policy-version"] = str(gen.policy_version)
    usage = Usage(prompt_tokens=len(prompt), completion_tokens=len(gen.token_ids),
                  total_tokens=len(prompt) + len(gen.token_ids))
    return CompletionResponse(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=settings.served_name,
                              choices=[_choice(body, prompt, gen, engine.tokenizer)], usage=usage)


def _to_engine_request(
    body: CompletionRequest, tokenizer: PreTrainedTokenizerBase, settings: ServerSettings
) -> tuple[list[int], SamplingParams]:
    """Validate against the server limits and map to engine inputs (HTTP 400 naming the bad field)."""
    if body.model is not None and body.model != settings.served_name:
        raise HTTPException(
            status_code=404, detail=f"model {body.model!r} is not served; use {settings.served_name!r}"
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
