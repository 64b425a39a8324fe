"""Request and response models of the gateway API, per role, with field limits.

Field names are the trainer's contract (docs/design.md, "Wire contracts"); change them only together with it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator
from sisrl.common.wire import DEFAULT_LOGPROBS_K, MAX_LOGPROBS_K, MAX_SIS_RECORDS
from sisrl.services.protocol import (
    CORRECTIVE,
    OBSERVATION_TEMPLATE,
    PASSAGE_TEMPLATE,
    PROMPT_TEMPLATE,
    template_error,
)
from sisrl.services.rewards import DEFAULT_SPECS

BatchStatus = Literal["running", "done", "failed", "partial"]
FinishReason = Literal["answer", "eos", "max_turns", "length", "error"]

# Stored text must not hold NUL: PostgreSQL text columns refuse it (SQLite would keep it), so it is a 422 here.
NO_NUL = r"^[^\x00]*$"
MAX_TEMPLATE = 32768  # characters of one protocol template
_ID = Field(min_length=1, max_length=256, pattern=NO_NUL)
_Text = Annotated[str, StringConstraints(pattern=NO_NUL)]
MAX_TOKENS = 65536  # the largest max_response_tokens (GatewaySettings): no per-token array is longer
F32_LIMIT = 3.0e38  # per-token floats are stored as float32 (max ~3.4e38): larger values would become inf


def first_repeat(values: list[Any]) -> Any | None:
    """The first value that occurs twice in `values` (in order of its second occurrence), or None."""
    seen: set[Any] = set()
    for value in values:
        if value in seen:
            return value
        seen.add(value)
    return None


class _Strict(BaseModel):
    """Request bodies: unknown fields and type coercions are refused (a JSON `"3"` or `true` is not an int), so
    what validates is what the OpenAPI schema says; a rule the schema cannot state is a 400 from the route
    (`rule_error`), never a 422 for a body the schema calls valid."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _integral_numbers(cls, value: Any) -> Any:
        """3.0 -> 3: JSON Schema counts an integral number as an integer (strict mode alone would refuse it)."""
        return int(value) if isinstance(value, float) and value.is_integer() else value


# ---- rollouts: create ------------------------------------------------------------------------------------------
class RolloutItem(_Strict):
    """One question to roll out `samples_per_item` times (one GRPO group)."""

    id: str = _ID
    question: str = Field(min_length=1, max_length=4096, pattern=NO_NUL)
    golden_answers: list[_Text] = Field(min_length=1, max_length=64)
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
    temperature: float = Field(default=1.0, ge=0.0, le=10.0,
                               description="0 = greedy decoding (q is then reported at temperature 1, as vLLM does)")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    logprobs_k: int = Field(default=DEFAULT_LOGPROBS_K, ge=1, le=MAX_LOGPROBS_K,
                            description="top-K recorded per sampled token")
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)


def _holds(slot: str) -> str:
    """A pattern for text without NUL that holds `{slot}` at least once."""
    return r"^[^\x00]*\{" + slot + r"\}[^\x00]*$"


class ProtocolIn(_Strict):
    """How the question becomes the prompt and each search's passages an observation (services/protocol.py).
    The defaults are the gateway's own protocol; docs/trainer.md, "Search-R1's protocol", gives Search-R1's."""

    prompt_template: str | None = Field(
        default=None, min_length=1, max_length=MAX_TEMPLATE, pattern=_holds("question"),
        description="the prompt text (the user turn when the chat template applies); every `{question}` is the "
                    "question, stripped. null = the gateway's instructions: " + repr(PROMPT_TEMPLATE))
    append_question_mark: bool = Field(
        default=False, description="append `?` to a question that does not end with one (Search-R1's data does)")
    apply_chat_template: bool | Literal["auto"] = Field(
        default=True, description="true: the prompt is one user message through the tokenizer's chat template with "
                                  "the assistant header after it (a tokenizer without one fails the batch); false: "
                                  "the prompt text tokenised as is (base models); 'auto': true when the tokenizer "
                                  "has a chat template (Search-R1's rule)")
    observation_template: str | None = Field(
        default=None, min_length=1, max_length=MAX_TEMPLATE, pattern=_holds("passages"),
        description="one search's observation; `{passages}` (exactly once) = the rendered passages. null = "
                    + repr(OBSERVATION_TEMPLATE))
    passage_template: str | None = Field(
        default=None, min_length=1, max_length=MAX_TEMPLATE, pattern=NO_NUL,
        description="one passage: `{i}` its rank from 1, `{title}` the first line of its contents, `{text}` the "
                    "rest. null = Search-R1's " + repr(PASSAGE_TEMPLATE))
    strip_passages: bool = Field(
        default=False, description="strip white space around the rendered passages (Search-R1 does)")
    observation_truncation: Literal["passages", "whole"] = Field(
        default="passages", description="'passages': the passages are cut to the budget, the template's text "
                                        "around them is kept whole; 'whole': the filled template is tokenised at "
                                        "once and cut to the budget, closing tag included (Search-R1)")
    observation_max_tokens: int | None = Field(
        default=None, ge=16, le=8192, description="token budget of one observation; null = the gateway's "
                                                  "--observation-max-tokens")
    invalid_action_message: str | None = Field(
        default=None, min_length=1, max_length=MAX_TEMPLATE, pattern=NO_NUL,
        description="inserted after a turn with neither a search nor an answer; null = " + repr(CORRECTIVE))

    def rule_error(self) -> str | None:
        if self.observation_template is None:
            return None
        return template_error("protocol.observation_template", self.observation_template, "passages", once=True)


class RolloutCreate(_Strict):
    """`POST /v1/rollouts` body."""

    run: str = _ID
    step: int = Field(ge=0, le=10**9)
    policy_version: int = Field(ge=0, le=10**9)
    min_policy_version: int | None = Field(
        default=None, ge=0, le=10**9,
        description="refuse the batch (409) unless the engine serves at least this policy version (the trainer "
                    "sets it to the version it just pushed); null = no check")
    items: list[RolloutItem] = Field(min_length=1, max_length=4096)
    samples_per_item: int = Field(default=1, ge=1, le=256)
    sampling: SamplingIn = Field(default_factory=SamplingIn)
    max_turns: int = Field(default=4, ge=1, le=32,
                           description="generations per trajectory at most: each search turn and the answer turn "
                                       "is one, so N allows N - 1 searches and an answer")
    protocol: ProtocolIn = Field(default_factory=ProtocolIn,
                                 description="prompt and observation format (default: the gateway's own)")
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=256, pattern=NO_NUL)

    def rule_error(self) -> str | None:
        """Why this schema-valid body cannot run (the route answers 400), or None."""
        dup = first_repeat([item.id for item in self.items])
        if dup is not None:
            return f"item ids must be unique within a batch, {dup!r} repeats"
        return self.protocol.rule_error()


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
    token_versions: list[int] | None = Field(
        default=None, description="policy version that sampled each token (its behaviour log-prob and top-K are that version's); "
                    "-1 where mask 0. Differs within a trajectory only when weights were loaded mid-rollout "
                    "(partial rollouts). Always set in responses")
    turns: list[Turn]
    finish_reason: FinishReason
    answer: str | None
    reward: float
    reward_parts: RewardParts
    policy_version: int = Field(description="version that sampled the first token")
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
    policy_version: int = Field(description="version that sampled the first token")
    policy_version_max: int = Field(description="version that sampled the last policy token (> policy_version "
                                    "when weights were loaded mid-rollout)")
    error: str | None


class TrajectoryTexts(BaseModel):
    """What the viewer shows of a trajectory's tokens, decoded by the gateway's tokenizer."""

    tokenizer: str | None = Field(description="the tokenizer that decoded; null when none is loaded (ids only)")
    prompt: str | None = Field(description="the prompt decoded as a whole")
    pieces: dict[str, str] = Field(description="token id -> its text alone, for every response and top-K id")


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
    error: str | None = Field(description="the error of the first stored trajectory that ended with one (a failed "
                              "batch's reason: every trajectory ended with an error); null when none did")


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


class RunSummary(BaseModel):
    run: str
    trajectories: int
    steps: int = Field(description="distinct steps with trajectories")
    first_step: int
    last_step: int
    sis_records: int


class RunList(BaseModel):
    data: list[RunSummary]
    count: int


# ---- SIS records (trainer -> gateway) --------------------------------------------------------------------------
SisStatus = Literal[-1, 0, 1, 2]
_F32 = Annotated[float, Field(ge=-F32_LIMIT, le=F32_LIMIT, allow_inf_nan=False)]


class SisRecordIn(_Strict):
    """The trainer's SIS decisions for one trajectory, from its last mini-batch pass: one entry per response
    token in every array (docs/design.md, "SIS records")."""

    trajectory_id: str = _ID
    policy_version: int = Field(ge=0, le=10**9, description="version of pi_theta the decisions were made with")
    advantage: _F32
    status: list[SisStatus] = Field(max_length=MAX_TOKENS, description="per response token: 1 accepted, 0 rejected "
                                    "(in V_K), 2 outside V_K (always rejected), -1 not a policy token (loss mask 0)")
    ratio: list[_F32] = Field(max_length=MAX_TOKENS, description="value of the ratio used in the loss (1 if accepted)")
    logp: list[_F32] = Field(max_length=MAX_TOKENS, description="log pi_theta(y_t)")
    log_m: list[_F32] = Field(max_length=MAX_TOKENS, description="log M_t = log max over V_K of pi_theta / q")

    def rule_error(self) -> str | None:
        sizes = {name: len(getattr(self, name)) for name in ("status", "ratio", "logp", "log_m")}
        if len(set(sizes.values())) > 1:
            return f"trajectory {self.trajectory_id!r}: per-token arrays differ in length {sizes}"
        return None


class SisRecordsCreate(_Strict):
    """`POST /v1/sis_records` body: one record per (trajectory, policy version); a repeated pair replaces."""

    run: str = _ID
    step: int = Field(ge=0, le=10**9, description="the trainer step of the update that made the decisions")
    # The limit is checked by the route (413), not here: a 422 would echo every record back.
    records: list[SisRecordIn] = Field(min_length=1, json_schema_extra={"maxItems": MAX_SIS_RECORDS})

    def rule_error(self) -> tuple[int, str] | None:
        """(record index, why) for the first record that breaks a rule the schema cannot state (HTTP 400)."""
        for i, record in enumerate(self.records):
            why = record.rule_error()
            if why is not None:
                return i, why
        pairs = [(r.trajectory_id, r.policy_version) for r in self.records]
        dup = first_repeat(pairs)
        if dup is not None:
            return pairs.index(dup, pairs.index(dup) + 1), f"trajectory {dup[0]!r} has two records for policy version {dup[1]}"
        return None


class SisStored(BaseModel):
    run: str
    step: int
    stored: int = Field(description="records written")
    replaced: int = Field(description="of those, records that replaced one with the same trajectory and version")


class SisSummary(BaseModel):
    """Counts over the policy tokens of one record; l_t = logp - behaviour_logprobs (log pi - log q)."""

    accepted: int
    rejected: int = Field(description="in V_K, failed the accept test")
    outside: int = Field(description="outside V_K")
    d: float = Field(description="D = sum over decided tokens of |l_t|")
    d_sis: float = Field(description="D_SIS = sum over rejected and outside tokens of |l_t|")


class SisRecordPublic(BaseModel):
    run: str
    step: int
    policy_version: int
    advantage: float
    status: list[int]
    ratio: list[float]
    logp: list[float]
    log_m: list[float]
    summary: SisSummary


class TrajectoryDetail(Trajectory):
    """`GET /v1/rollouts/{id}`: the trajectory and its newest SIS record."""

    sis: SisRecordPublic | None = Field(description="the record of the highest policy version; null when none")


class SisStepStats(BaseModel):
    step: int
    records: int
    policy_tokens: int = Field(description="decided tokens: accepted + rejected + outside")
    accepted: int
    rejected: int
    outside: int
    accept_rate: float = Field(description="accepted / policy_tokens (0 when there are none)")
    d_mean: float = Field(description="mean D per record")
    d_sis_mean: float = Field(description="mean D_SIS per record")


class SisRunStats(BaseModel):
    run: str
    data: list[SisStepStats]
    count: int


class TokenCount(BaseModel):
    token_id: int
    text: str | None = Field(description="the token decoded alone; null without a tokenizer")
    accepted: int
    rejected: int
    outside: int


class SisTokens(BaseModel):
    """The tokens most often accepted and most often rejected (rejected + outside) in a run (paper, Fig. 5)."""

    run: str
    records_scanned: int
    truncated: bool = Field(description="true when only the newest `max_records` records were read")
    most_accepted: list[TokenCount]
    most_rejected: list[TokenCount]


# ---- policy and health -----------------------------------------------------------------------------------------
class PolicyUpdate(_Strict):
    path: str = Field(min_length=1, max_length=4096, description="checkpoint directory under the checkpoint root")
    version: int = Field(ge=0, le=10**9)
    partial: bool = Field(
        default=False,
        description="false: running trajectories finish on the weights they started with (new ones wait for the "
                    "load); true: the load does not wait for them, their later tokens come from the new weights "
                    "(between decode steps on an engine that can, else between turns; see /health load_granularity)")


class PolicyPublic(BaseModel):
    policy_version: int
    path: str | None


class RolloutSettings(BaseModel):
    """The gateway's settings that shape every trajectory and reward and that no request carries (set at its start)."""

    topk: int = Field(description="passages per search (--topk)")
    observation_max_tokens: int = Field(description="token budget of one <information> block (--observation-max-tokens)")
    max_response_tokens: int = Field(description="sampled + inserted tokens per trajectory (--max-response-tokens)")
    format_weight: float = Field(description="weight of the format reward (--format-weight)")


class Health(BaseModel):
    status: Literal["ok"]
    policy_version: int | None = Field(description="version loaded in the engine; null when store-only")
    engine: str = Field(description="the engine, or `store-only` (no engine: stored rollouts and the viewer)")
    load_granularity: Literal["decode-step", "turn"] | None = Field(
        default=None, description="where a partial weight load (POST /v1/policy partial=true) lands inside a "
        "running trajectory: between two decode steps, or between two turns (generations); null when store-only")
    weights_dtype: str | None = Field(default=None, description="dtype the engine holds its weights in (float32, "
                                      "bfloat16, float16), the one a trainer pushes in; null when store-only or "
                                      "unknown (vLLM choosing its own)")
    inflight_trajectories: int
    store_only: bool
    token_required: bool = Field(description="every route but /health and /ui needs `Authorization: Bearer`")
    rollout: RolloutSettings | None = Field(default=None, description="the settings every trajectory here is made "
                                            "with that a request cannot set; null when store-only")
