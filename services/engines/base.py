"""The one async interface every inference engine implements (token-in, token-out).

An engine takes prompt token ids and sampling parameters and returns the sampled token ids together with what
SIS needs about the behaviour policy q (docs/design.md, "Behaviour top-K"): log q(y_t) of every sampled token
and the top-K ids / log-probs of q at every generated position. q is the distribution the token was actually
sampled from, i.e. after temperature and top-p. Nothing is ever decoded and re-tokenised.

Conventions shared by all engines:
- Log-probs are clamped below at `MIN_LOGPROB` (-9999.0, the floor vLLM's OpenAI server also uses), so tokens
  that top-p removed carry a finite, JSON-safe value instead of -inf.
- `temperature == 0` (any value below GREEDY_TEMPERATURE) means greedy decoding; q is then reported at temperature 1 without top-p (vLLM does the
  same for greedy requests). Negative temperatures are refused.
- Top-K entries are ordered by rank under q (most probable first); ties keep the model's logit order. When
  top-p leaves fewer than K tokens in q's support, the row ends in padding at MIN_LOGPROB whose ids carry no
  rank (vLLM: arbitrary ids; the local engine: raw-logit order); `trainer.sis.topk_in_support` drops them.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from sisrl.common.wire import DEFAULT_LOGPROBS_K, MIN_LOGPROB

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Temperatures below this decode greedily (vLLM's sampling epsilon): 1/temperature would overflow the logits.
GREEDY_TEMPERATURE = 1e-5
FINISH_REASONS = ("stop", "eos", "length")
ENGINE_KINDS = ("local", "vllm-http", "vllm")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one continuation. Validated at construction (ValueError naming the field)."""

    max_new_tokens: int = 256  # generated tokens at most (stop text and EOS included)
    temperature: float = 1.0  # 0 = greedy; > 0 scales the logits by 1/temperature
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 disables it
    logprobs_k: int = DEFAULT_LOGPROBS_K  # K: top-K ids/log-probs of q recorded per generated position
    stop: tuple[str, ...] = ("</search>", "</answer>")  # generation ends after any of these (text kept)
    seed: int | None = None  # per-request RNG seed; None draws a fresh one

    def __post_init__(self) -> None:
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a sequence of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature!r}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.logprobs_k, int) or self.logprobs_k < 0:
            raise ValueError(f"logprobs_k must be an int >= 0, got {self.logprobs_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be None or an int >= 0, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass
class Generation:
    """One sampled continuation and its behaviour-policy record. T = len(token_ids), K = logprobs_k."""

    token_ids: list[int]  # [T] sampled ids, stop text included
    logprobs: list[float]  # [T] log q(y_t) under the processed (post temperature / top-p) distribution
    topk_ids: list[list[int]]  # [T][K] top-K ids of q at each position, most probable first (then padding)
    topk_logprobs: list[list[float]]  # [T][K] their log q
    finish_reason: str  # "stop" (stop string), "eos", "length"
    policy_version: int = 0  # version of the weights that produced the first token
    # [T] version that sampled each token, when a weight load landed inside this generation (an engine with
    # `load_weights_mid_request`); None = every token is `policy_version`'s.
    token_versions: list[int] | None = None

    def versions(self) -> list[int]:
        """[T] the policy version that sampled each token."""
        if self.token_versions is not None:
            return list(self.token_versions)
        return [self.policy_version] * len(self.token_ids)

    def validate(self, k: int) -> None:
        """Raise ValueError when the record is not [T] / [T][K] consistent or the finish reason is unknown."""
        t = len(self.token_ids)
        if len(self.logprobs) != t or len(self.topk_ids) != t or len(self.topk_logprobs) != t:
            raise ValueError(
                f"inconsistent lengths: token_ids {t}, logprobs {len(self.logprobs)}, "
                f"topk_ids {len(self.topk_ids)}, topk_logprobs {len(self.topk_logprobs)}"
            )
        for i, (ids, lps) in enumerate(zip(self.topk_ids, self.topk_logprobs, strict=True)):
            if len(ids) != k or len(lps) != k:
                raise ValueError(f"position {i}: expected {k} top-K entries, got {len(ids)} ids / {len(lps)}")
        if self.token_versions is not None and len(self.token_versions) != t:
            raise ValueError(f"token_versions has {len(self.token_versions)} entries for {t} tokens")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")


@runtime_checkable
class Engine(Protocol):
    """An inference engine behind the rollout gateway. All methods are safe to call concurrently."""

    policy_version: int

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Sample one continuation of `prompt_ids` ([P] token ids, P >= 1)."""
        ...

    async def load_weights(self, path: str, version: int) -> None:
        """Load the safetensors Hugging Face directory at `path`; later generations carry `version`."""
        ...

    async def close(self) -> None:
        """Release the model / connections. The engine is unusable afterwards."""
        ...


@runtime_checkable
class MidRequestLoads(Protocol):
    """An engine that can take new weights while generations run (partial rollouts, docs/engines.md).

    `load_weights_mid_request` swaps the weights between two decode steps without waiting for running
    generations; their later tokens come from the new weights and carry the new version in
    `Generation.token_versions`. Each running sequence's prefix is recomputed under the new weights first, so a
    recorded log-prob is that of a fresh forward pass of the version that sampled the token."""

    async def load_weights_mid_request(self, path: str, version: int) -> None: ...


def check_prompt(prompt_ids: list[int], vocab_size: int | None = None) -> None:
    """Raise ValueError unless `prompt_ids` is a non-empty list of in-vocabulary token ids."""
    if not prompt_ids:
        raise ValueError("prompt_ids must contain at least one token id, got []")
    for i, tok in enumerate(prompt_ids):
        if not isinstance(tok, int) or tok < 0 or (vocab_size is not None and tok >= vocab_size):
            raise ValueError(f"prompt_ids[{i}] = {tok!r} is not a token id in [0, {vocab_size})")


def clamp_logprob(value: float) -> float:
    """Floor a log-prob at MIN_LOGPROB (maps -inf and NaN-free underflow to a JSON-safe value)."""
    return value if value > MIN_LOGPROB else MIN_LOGPROB


def create_engine(kind: str, *, model: str | PreTrainedModel, url: str | None = None, **kw: Any) -> Engine:
    """Build an engine by kind: "local" (transformers), "vllm-http" (vLLM OpenAI server), "vllm" (in-process).

    `model` is a name / path (`smollm2-135m-instruct`, an HF directory) or, for "local", a built model object
    (pass its `tokenizer=` too). `url` is the server base URL for "vllm-http". Extra keywords go to the engine.
    """
    if kind == "local":
        local = importlib.import_module("sisrl.services.engines.local")
        engine: Engine = local.LocalEngine(model, **kw)
    elif kind == "vllm-http":
        if url is None:
            raise ValueError("engine kind 'vllm-http' needs url='http://host:port'")
        if not isinstance(model, str):
            raise ValueError(
                f"engine kind 'vllm-http' needs model as the served model name, got {type(model)}"
            )
        http = importlib.import_module("sisrl.services.engines.vllm_http")
        engine = http.VLLMHttpEngine(url, model=model, **kw)
    elif kind == "vllm":
        if not isinstance(model, str):
            raise ValueError(f"engine kind 'vllm' needs model as a name or path, got {type(model)}")
        inproc = importlib.import_module("sisrl.services.engines.vllm_inproc")
        engine = inproc.VLLMEngine(model, **kw)
    else:
        raise ValueError(f"unknown engine kind {kind!r}; expected one of {ENGINE_KINDS}")
    return engine


__all__ = [
    "ENGINE_KINDS",
    "FINISH_REASONS",
    "GREEDY_TEMPERATURE",
    "MIN_LOGPROB",
    "Engine",
    "Generation",
    "MidRequestLoads",
    "SamplingParams",
    "check_prompt",
    "clamp_logprob",
    "create_engine",
]
