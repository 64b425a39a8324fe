"""Pydantic models of the OpenAI-compatible completions server, in vLLM's wire format.

Wire format source: vLLM's OpenAI server (`vllm/entrypoints/openai/protocol.py`, `serving_completion.py`):
`return_tokens_as_token_ids` renders tokens as `token_id:N`; `return_token_ids` adds `token_ids` and
`prompt_token_ids` to each choice; `top_logprobs[t]` holds the sampled token first, then the top-K by rank
(K + 1 entries when the sampled token is outside the top-K); log-probs are floored at -9999.0.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

MAX_PROMPT_TOKENS = 1 << 17


def _integral_number(value: object) -> object:
    # The schema's `integer` includes 3.0 (JSON Schema); strict mode alone would refuse it. A bool stays a bool,
    # which strict mode refuses: `true` is not an integer on the wire.
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _no_bool(value: object) -> object:
    # A Literal[1] compares equal to True in Python; on the wire `true` is not the integer 1.
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    return value


def _bool_only(value: object) -> object:
    # Literal[False] compares equal to 0; on the wire `0` is not `false`.
    if not isinstance(value, bool):
        raise ValueError("expected a boolean")
    return value


NoBool = BeforeValidator(_no_bool)
OnlyFalse = Annotated[Literal[False], BeforeValidator(_bool_only)]
IntegralNumber = BeforeValidator(_integral_number)
TokenId = Annotated[int, Field(ge=0, le=(1 << 31) - 1), IntegralNumber]
StopText = Annotated[str, Field(min_length=1, max_length=256)]


class CompletionRequest(BaseModel):
    """`POST /v1/completions`. Unknown fields are ignored (as vLLM does); sampling knobs we cannot honour are refused.

    Strict: a value is accepted only in the schema's own JSON type (no "3" for 3, no `true` for 1)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = Field(
        None, max_length=256, description="Served model name (optional; checked if given)."
    )
    prompt: (
        Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]
        | Annotated[str, Field(min_length=1, max_length=1 << 20)]
    ) = Field(description="Prompt token ids (token-in), or text that the server tokenises.")
    max_tokens: Annotated[int, IntegralNumber] = Field(
        16, ge=1, le=1 << 20, description="Generated tokens at most."
    )
    temperature: float = Field(1.0, ge=0.0, le=1e6, allow_inf_nan=False, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: Annotated[Literal[-1, 0], NoBool] = Field(
        -1, description="Only 'disabled' (-1 or 0) is supported."
    )
    min_p: float = Field(0.0, ge=0.0, le=0.0, description="Only 0 (disabled) is supported.")
    repetition_penalty: float = Field(1.0, ge=1.0, le=1.0, description="Only 1 (disabled) is supported.")
    logprobs: Annotated[int, Field(ge=0, le=1 << 20), IntegralNumber] | None = Field(
        None, description="K: top-K log-probs per generated token."
    )
    stop: StopText | Annotated[list[StopText], Field(max_length=16)] | None = None
    seed: Annotated[int, Field(ge=0, le=(1 << 63) - 1), IntegralNumber] | None = None
    n: Annotated[Literal[1], NoBool] = 1
    stream: OnlyFalse = False
    echo: OnlyFalse = False
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
