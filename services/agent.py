"""The search-agent loop: Search-R1's multi-turn protocol, token-in/token-out.

Protocol (format of Search-R1, `search_r1/llm_agent/generation.py`; the wording here is ours): the policy thinks
in `<think>`, searches with `<search>query</search>`, receives `<information>...</information>` and finishes
with `<answer>...</answer>`. An unparsable turn gets a corrective message; the loop stops after `max_turns`
generations. The trajectory's ids are exactly the sampled ids plus the inserted ids (observations, corrective
messages), each inserted piece tokenised once on its own; nothing is decoded and re-tokenised. Sampled tokens
carry loss mask 1, their behaviour log-prob / top-K and the policy version that sampled them; inserted tokens
carry mask 0, 0.0, zero rows and version -1. How the prompt and the observations are written is the request's
protocol (`ProtocolSpec`, services/protocol.py): our instructions and chat template by default.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from sisrl.services.engines.base import Engine, SamplingParams
from sisrl.services.protocol import CORRECTIVE as CORRECTIVE  # re-exported: the scripted engine parses it
from sisrl.services.protocol import OBSERVATION_TEMPLATE, PASSAGE_TEMPLATE, ProtocolSpec, fill
from sisrl.services.retrieval_client import Passage
from sisrl.services.timing import BusyClock
from transformers import PreTrainedTokenizerBase

INFO_OPEN, _, INFO_CLOSE = OBSERVATION_TEMPLATE.partition("{passages}")  # "\n\n<information>", "</information>\n\n"
_ACTION_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


class Searcher(Protocol):
    async def search(self, query: str) -> list[Passage]: ...


def render_passages(passages: list[Passage], template: str = PASSAGE_TEMPLATE) -> str:
    """One `template` per passage (default Search-R1's `Doc i(Title: T) text` line), i from 1."""
    return "".join(fill(template, {"i": str(i), "title": p.title, "text": p.text})
                   for i, p in enumerate(passages, start=1))


def parse_action(text: str) -> tuple[str, str] | None:
    """The first complete `<search>` or `<answer>` of one turn as (kind, content), None when there is none."""
    match = _ACTION_RE.search(text)
    return (match.group(1), match.group(2).strip()) if match else None


class SearchR1Protocol:
    """Prompt and observation token ids of one protocol (`spec`) for one tokenizer (inserted pieces cached).

    `observation_max_tokens` is the gateway's budget of one observation, used where `spec` sets none.
    ValueError when the tags fill that budget, and from `prompt_ids` when there is no chat template to apply."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, observation_max_tokens: int = 512,
                 spec: ProtocolSpec | None = None) -> None:
        self.tokenizer = tokenizer
        self.spec = spec or ProtocolSpec()
        self.default_max_tokens = observation_max_tokens
        self.max_tokens = self.spec.observation_max_tokens or observation_max_tokens
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self.chat = self.spec.apply_chat_template is True or (
            self.spec.apply_chat_template == "auto" and self.has_chat_template)
        head, _, tail = self.spec.observation_template.partition("{passages}")
        self._open = self.encode(head)
        self._close = self.encode(tail)
        self.corrective_ids = self.encode(self.spec.invalid_action_message)
        self.body_budget = self.max_tokens - len(self._open) - len(self._close)
        if self.spec.observation_truncation == "passages" and self.body_budget < 1:
            raise ValueError(f"observation_max_tokens={self.max_tokens} leaves no room inside the tags")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, question: str) -> list[int]:
        """The prompt text, tokenised as is, or as one user turn through the chat template with the assistant
        header after it (the policy writes the assistant turn)."""
        text = self.spec.prompt_text(question)
        if not self.chat:
            return self.encode(text)
        if not self.has_chat_template:  # a base model's tokenizer: the request must say false or "auto"
            raise ValueError("apply_chat_template=true, but the tokenizer has no chat template: set it false "
                             "(the prompt text tokenised as is) or 'auto'")
        messages = [{"role": "user", "content": text}]
        out: Any = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return [int(tok) for tok in out["input_ids"]]

    def observation_ids(self, passages: list[Passage]) -> list[int]:
        """The observation of one search, at most `max_tokens` long. Truncation "passages": the head and tail of
        the template around the rendered passages, each tokenised alone, the passages cut to fit (the closing tag
        is never cut). "whole" (Search-R1's `_process_next_obs`): the filled template tokenised at once, then cut."""
        body = render_passages(passages, self.spec.passage_template)
        if self.spec.strip_passages:
            body = body.strip()
        if self.spec.observation_truncation == "whole":
            return self.encode(fill(self.spec.observation_template, {"passages": body}))[: self.max_tokens]
        return self._open + self.encode(body)[: self.body_budget] + self._close

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int = 4  # generations per trajectory
    max_response_tokens: int = 2048  # sampled + inserted tokens per trajectory


@dataclass
class SearchTurn:
    query: str
    doc_ids: list[str]
    scores: list[float]


@dataclass
class Rollout:
    """What the loop produced; per-token lists have len(response_ids) entries, top-K rows have K entries."""

    prompt_ids: list[int]
    k: int
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)  # policy version per token; -1 = inserted
    turn_texts: list[str] = field(default_factory=list)
    valid_actions: int = 0
    searches: list[SearchTurn] = field(default_factory=list)
    finish_reason: str = "max_turns"
    error: str | None = None
    policy_version: int | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def add_sampled(self, ids: list[int], logprobs: list[float], topk_ids: list[list[int]],
                    topk_logprobs: list[list[float]], versions: list[int]) -> None:
        self.response_ids += ids
        self.token_versions += versions
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.topk_ids += topk_ids
        self.topk_logprobs += topk_logprobs

    def add_inserted(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.token_versions += [-1] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.topk_ids += [[0] * self.k for _ in ids]
        self.topk_logprobs += [[0.0] * self.k for _ in ids]

    def add_time(self, key: str, seconds: float) -> None:
        self.timings[key] = self.timings.get(key, 0.0) + seconds


async def run_agent(
    *,
    engine: Engine,
    searcher: Searcher,
    protocol: SearchR1Protocol,
    question: str,
    params: SamplingParams,
    limits: AgentLimits,
    clock: BusyClock | None = None,
) -> Rollout:
    """Roll out one trajectory; a prompt the protocol cannot make, engine and retriever failures end it with
    `finish_reason="error"`."""
    clock = clock or BusyClock()
    try:
        prompt_ids = protocol.prompt_ids(question)
    except ValueError as exc:  # the protocol cannot be served (no chat template): the trajectory says why
        return Rollout(prompt_ids=[], k=params.logprobs_k, finish_reason="error", error=f"protocol: {exc}",
                       timings={"total_s": 0.0})
    rollout = Rollout(prompt_ids=prompt_ids, k=params.logprobs_k)
    start = time.perf_counter()
    try:
        await _loop(engine, searcher, protocol, rollout, params, limits, clock)
    finally:
        rollout.timings["total_s"] = time.perf_counter() - start
    return rollout


async def _loop(engine: Engine, searcher: Searcher, protocol: SearchR1Protocol, rollout: Rollout,
                params: SamplingParams, limits: AgentLimits, clock: BusyClock) -> None:
    for turn in range(limits.max_turns):
        budget = limits.max_response_tokens - len(rollout.response_ids)
        if budget <= 0:
            rollout.finish_reason = "length"
            return
        turn_params = replace(params, max_new_tokens=min(params.max_new_tokens, budget),
                              seed=None if params.seed is None else (params.seed + turn) % 2**31)
        t0 = time.perf_counter()
        try:
            with clock.span("engine"):
                gen = await engine.generate(rollout.prompt_ids + rollout.response_ids, turn_params)
            gen.validate(params.logprobs_k)
        except Exception as exc:  # the trajectory records the failure instead of vanishing
            rollout.finish_reason, rollout.error = "error", f"engine: {type(exc).__name__}: {exc}"
            return
        finally:
            rollout.add_time("engine_s", time.perf_counter() - t0)
        if rollout.policy_version is None:
            rollout.policy_version = gen.policy_version
        rollout.add_sampled(gen.token_ids, gen.logprobs, gen.topk_ids, gen.topk_logprobs, gen.versions())
        text = protocol.decode(gen.token_ids)
        rollout.turn_texts.append(text)
        action = parse_action(text)
        if action is not None:
            rollout.valid_actions += 1
        if action is not None and action[0] == "answer":
            rollout.finish_reason = "answer"
            return
        if action is None and gen.finish_reason == "eos":
            rollout.finish_reason = "eos"
            return
        if turn == limits.max_turns - 1:
            return  # no turn left to use an observation: finish_reason stays "max_turns"
        if action is None:
            if not _insert(rollout, protocol.corrective_ids, limits):
                return
            continue
        if not await _search(searcher, protocol, rollout, action[1], clock, limits):
            return


def _insert(rollout: Rollout, ids: list[int], limits: AgentLimits) -> bool:
    """Append inserted ids when they fit: `max_response_tokens` counts sampled + inserted tokens, so a piece
    that would pass it is not inserted and the trajectory ends with finish reason `length`."""
    if len(rollout.response_ids) + len(ids) > limits.max_response_tokens:
        rollout.finish_reason = "length"
        return False
    rollout.add_inserted(ids)
    return True


async def _search(searcher: Searcher, protocol: SearchR1Protocol, rollout: Rollout, query: str,
                  clock: BusyClock, limits: AgentLimits) -> bool:
    t0 = time.perf_counter()
    try:
        with clock.span("retriever"):
            passages = await searcher.search(query)
    except Exception as exc:
        rollout.finish_reason, rollout.error = "error", f"retriever: {type(exc).__name__}: {exc}"
        return False
    finally:
        rollout.add_time("retriever_s", time.perf_counter() - t0)
    if not _insert(rollout, protocol.observation_ids(passages), limits):
        return False  # the policy never sees these passages, so no search turn is recorded
    rollout.searches.append(SearchTurn(query=query, doc_ids=[p.id for p in passages],
                                       scores=[p.score for p in passages]))
    return True
