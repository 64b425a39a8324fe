"""Pydantic models of the OpenAI-compatible completions server, in vLLM's wire format.

Wire format source: vLLM's OpenAI server (`vllm/entrypoints/openai/protocol.py`, `serving_completion.py`):
`return_tokens_as_token_ids` renders tokens as `token_id:N`; `return_token_ids` adds `token_ids` and
`prompt_token_ids` to each choice; `top_logprobs[t]` holds the sampled token first, then the top-K by rank
(K + 1 entries when the sampled token is outside the top-K); log-probs are floored at -9999.0.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_PROMPT_TOKENS = 1 << 17
TokenId = Annotated[int, Field(ge=0, le=(1 << 31) - 1)]
StopText = Annotated[str, Field(min_length=1, max_length=256)]


class CompletionRequest(BaseModel):
    """`POST /v1/completions`. Unknown fields are ignored (as vLLM does); sampling knobs we cannot honour are refused."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(
        None, max_length=256, description="Served model name (optional; checked if given)."
    )
    prompt: (
        Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]
        | Annotated[str, Field(min_length=1, max_length=1 << 20)]
    ) = Field(description="Prompt token ids (token-in), or text that the server tokenises.")
    max_tokens: int = Field(16, ge=1, le=1 << 20, description="Generated tokens at most.")
    temperature: float = Field(1.0, ge=0.0, le=1e6, allow_inf_nan=False, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: Literal[-1, 0] = Field(-1, description="Only 'disabled' (-1 or 0) is supported.")
    min_p: float = Field(0.0, ge=0.0, le=0.0, description="Only 0 (disabled) is supported.")
    repetition_penalty: float = Field(1.0, ge=1.0, le=1.0, description="Only 1 (disabled) is supported.")
    logprobs: int | None = Field(
        None, ge=0, le=1 << 20, description="K: top-K log-probs per generated token."
    )
    stop: StopText | Annotated[list[StopText], Field(max_length=16)] | None = None
    seed: int | None = Field(None, ge=0, le=(1 << 63) - 1)
    n: Literal[1] = 1
    stream: Literal[False] = False
    echo: Literal[False] = False
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionLogprobs(BaseModel):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    stop_reason: int | str | None = Field(
        None, description="The stop string that ended generation; None at EOS."
    )
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class LoadWeightsRequest(BaseModel):
    """`POST /v1/load_weights`: a safetensors HF directory under the server's checkpoint root."""

    path: str = Field(min_length=1, max_length=4096)
    version: int = Field(ge=0, le=(1 << 62))


class LoadWeightsResponse(BaseModel):
    policy_version: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    owned_by: str = "sisrl"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str
    policy_version: int
