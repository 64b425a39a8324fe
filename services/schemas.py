"""Request and response models of the gateway API, per role, with field limits.

Field names are the trainer's contract (DESIGN.md "Wire contracts"); change them only together with it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from sisrl.common.wire import DEFAULT_LOGPROBS_K, MAX_LOGPROBS_K
from sisrl.services.rewards import DEFAULT_SPECS

BatchStatus = Literal["running", "done", "failed", "partial"]
FinishReason = Literal["answer", "eos", "max_turns", "length", "error"]

_ID = Field(min_length=1, max_length=256)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- rollouts: create ------------------------------------------------------------------------------------------
class RolloutItem(_Strict):
    """One question to roll out `samples_per_item` times (one GRPO group)."""

    id: str = _ID
    question: str = Field(min_length=1, max_length=4096)
    golden_answers: list[str] = Field(min_length=1, max_length=64)
    data_source: str = Field(min_length=1, max_length=64, description="selects the reward rule (nq, hotpotqa, ...)",
                             json_schema_extra={"enum": sorted(DEFAULT_SPECS)})

    @field_validator("data_source")
    @classmethod
    def _known_source(cls, value: str) -> str:
        if value not in DEFAULT_SPECS:
            raise ValueError(f"unknown data_source {value!r}, expected one of {sorted(DEFAULT_SPECS)}")
        return value


class SamplingIn(_Strict):
    """Sampling parameters for every generation of the batch."""

    max_new_tokens: int = Field(default=256, ge=1, le=4096, description="tokens per generation (one turn)")
    temperature: float = Field(default=1.0, gt=0.0, le=10.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    logprobs_k: int = Field(default=DEFAULT_LOGPROBS_K, ge=1, le=MAX_LOGPROBS_K,
                            description="top-K recorded per sampled token")
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)


class RolloutCreate(_Strict):
    """`POST /v1/rollouts` body."""

    run: str = _ID
    step: int = Field(ge=0, le=10**9)
    policy_version: int = Field(ge=0, le=10**9)
    items: list[RolloutItem] = Field(min_length=1, max_length=4096)
    samples_per_item: int = Field(default=1, ge=1, le=256)
    sampling: SamplingIn = Field(default_factory=SamplingIn)
    max_turns: int = Field(default=4, ge=1, le=32)
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _unique_items(self) -> RolloutCreate:
        ids = [item.id for item in self.items]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"item ids must be unique within a batch, {dup!r} repeats")
        return self


class BatchCreated(BaseModel):
    batch_id: str
    status: BatchStatus


# ---- trajectories: public --------------------------------------------------------------------------------------
class Turn(BaseModel):
    query: str
    doc_ids: list[str]
    scores: list[float]


class RewardParts(BaseModel):
    em: float
    f1: float
    format: float


class Trajectory(BaseModel):
    """One rollout. Every per-token array has len(response_ids) rows; topk arrays are [len(response_ids), K]."""

    id: str
    batch_id: str
    item_id: str
    group_id: str
    run: str
    step: int
    data_source: str
    question: str
    golden_answers: list[str]
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int] = Field(description="1 = sampled by the policy, 0 = inserted by the environment")
    behaviour_logprobs: list[float] = Field(description="log q(token) of each sampled token; 0.0 where mask 0")
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]
    turns: list[Turn]
    finish_reason: FinishReason
    answer: str | None
    reward: float
    reward_parts: RewardParts
    policy_version: int
    timings: dict[str, float]
    error: str | None


class TrajectorySummary(BaseModel):
    """A trajectory without its token arrays (rollout listings)."""

    id: str
    batch_id: str
    item_id: str
    group_id: str
    run: str
    step: int
    data_source: str
    finish_reason: FinishReason
    answer: str | None
    reward: float
    reward_parts: RewardParts
    num_searches: int
    response_len: int
    policy_version: int
    error: str | None


class RolloutPage(BaseModel):
    data: list[TrajectorySummary]
    count: int
    next_cursor: str | None = Field(description="pass as `cursor` for the next page; null on the last page")


# ---- batches ---------------------------------------------------------------------------------------------------
class Progress(BaseModel):
    done: int
    total: int


class BatchPublic(BaseModel):
    batch_id: str
    run: str
    step: int
    status: BatchStatus
    progress: Progress
    missing_items: list[str] = Field(description="item ids that still lack some of their samples")
    trajectories: list[Trajectory] | None = Field(description="all trajectories, once the batch is done")


# ---- runs ------------------------------------------------------------------------------------------------------
class StepStats(BaseModel):
    step: int
    trajectories: int
    reward_mean: float
    em_by_source: dict[str, float]
    searches_mean: float
    response_len_mean: float
    finish_reasons: dict[str, int]


class RunStats(BaseModel):
    run: str
    data: list[StepStats]
    count: int


# ---- policy and health -----------------------------------------------------------------------------------------
class PolicyUpdate(_Strict):
    path: str = Field(min_length=1, max_length=4096, description="checkpoint directory under the checkpoint root")
    version: int = Field(ge=0, le=10**9)


class PolicyPublic(BaseModel):
    policy_version: int
    path: str | None


class Health(BaseModel):
    status: Literal["ok"]
    policy_version: int
    engine: str
    inflight_trajectories: int
