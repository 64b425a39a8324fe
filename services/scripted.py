"""A scripted policy: the benchmark's workload driver and a deterministic engine for protocol tests.

The script fixes the text of each turn per question (rules match a substring of the question; the first match
wins, an empty `match` is the default). The policy is deterministic, so log q of every emitted token is 0.0;
its top-K row is the emitted token at 0.0 followed by K-1 other ids at MIN_LOGPROB (log 0, floored).
With `base`, every turn first runs the real engine on the real context for as many tokens as the scripted turn
has (stop strings off), so engine time and batching are those of the real engine while the turn counts follow
the script. Script file (JSON): `{"rules": [{"match": "capital", "turns": ["<search>x</search>", "..."]}]}`.

Teacher mode (demonstrations for a warm start): a rule may name `extract`ed values, each the first regex group
of a `pattern` applied to the question (`"from": "question"`), to the latest `<information>` block the
gateway inserted (`"from": "info"`) or to the latest search query (`"from": "query"`, the text between the last
`<search>` and `</search>`: what a three-hop chain searched for). Turns use them as `{name}`; a pattern may use
an earlier value as `{name}` (inserted regex-escaped). When a pattern finds nothing (the retriever did not return
the evidence), the turn is the rule's `fallback` instead, so a demonstration only answers from what was actually
retrieved.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from sisrl.services.agent import CORRECTIVE, INFO_CLOSE, INFO_OPEN
from sisrl.services.engines.base import MIN_LOGPROB, Engine, Generation, SamplingParams
from sisrl.services.engines.pool import for_trajectory
from transformers import PreTrainedTokenizerBase

_QUESTION_MARK = "\nQuestion: "
_SOURCES = ("question", "info", "query")
_SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)
_NAME = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class Extract:
    """A value the teacher reads: group 1 of `pattern` in the question, the latest information block or the
    latest search query."""

    source: str
    pattern: str


@dataclass(frozen=True)
class ScriptRule:
    match: str
    turns: tuple[str, ...]
    extract: dict[str, Extract] = field(default_factory=dict)
    fallback: str = "<answer> unknown </answer>"

    def render(self, turn: str, question: str, info: str, query: str = "") -> str:
        """`turn` with its `{name}` values filled in, or `fallback` when one cannot be read."""
        values: dict[str, str] = {}
        texts = {"question": question, "info": info, "query": query}
        for name in _NAME.findall(turn):
            if self._resolve(name, texts, values) is None:
                return self.fallback
        return _NAME.sub(lambda m: values.get(m.group(1), m.group(0)), turn)

    def _resolve(self, name: str, texts: dict[str, str], values: dict[str, str]) -> str | None:
        if name in values:
            return values[name]
        spec = self.extract.get(name)
        if spec is None:
            raise ValueError(f"script rule {self.match!r}: turn uses {{{name}}}, which no extract defines")
        pattern = spec.pattern
        for ref in _NAME.findall(pattern):
            if ref in self.extract:
                value = self._resolve(ref, texts, values)
                if value is None:
                    return None
                pattern = pattern.replace("{" + ref + "}", re.escape(value))
        found = re.search(pattern, texts[spec.source])
        if found is None or not found.group(1).strip():
            return None
        values[name] = found.group(1).strip()
        return values[name]


def _parse_extract(raw: object, where: str) -> dict[str, Extract]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"{where}.extract must map names to {{'from': 'question'|'info', 'pattern': str}}")
    out = {}
    for name, spec in raw.items():
        source = spec.get("from") if isinstance(spec, dict) else None
        pattern = spec.get("pattern") if isinstance(spec, dict) else None
        if source not in _SOURCES or not isinstance(pattern, str):
            raise ValueError(f"{where}.extract.{name}: expected {{'from': one of {_SOURCES}, 'pattern': str}}, "
                             f"got {spec!r}")
        try:
            if re.compile(pattern).groups < 1:
                raise ValueError(f"{where}.extract.{name}: pattern {pattern!r} needs one capture group")
        except re.error as err:
            raise ValueError(f"{where}.extract.{name}: bad pattern {pattern!r} ({err})") from None
        out[str(name)] = Extract(source=source, pattern=pattern)
    return out


def load_script(path: Path) -> list[ScriptRule]:
    """Read a script file; ValueError naming the file and the bad entry."""
    data = json.loads(Path(path).read_text())
    rules = data.get("rules") if isinstance(data, dict) else None
    if not isinstance(rules, list) or not rules:
        raise ValueError(f"{path}: expected {{'rules': [{{'match': str, 'turns': [str, ...]}}, ...]}}")
    out = []
    for i, rule in enumerate(rules):
        turns = rule.get("turns") if isinstance(rule, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise ValueError(f"{path}: rules[{i}].turns must be a non-empty list of non-empty strings")
        extract = _parse_extract(rule.get("extract"), f"{path}: rules[{i}]")
        fallback = rule.get("fallback", ScriptRule.fallback)
        if not isinstance(fallback, str) or not fallback:
            raise ValueError(f"{path}: rules[{i}].fallback must be a non-empty string, got {fallback!r}")
        out.append(ScriptRule(match=str(rule.get("match", "")), turns=tuple(turns), extract=extract,
                              fallback=fallback))
    return out


class ScriptedEngine:
    """Engine protocol over a script (see module docstring); safe to call concurrently."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, rules: list[ScriptRule], *,
                 base: Engine | None = None) -> None:
        self.tokenizer = tokenizer
        self.rules = rules
        self.base = base
        self.policy_version = base.policy_version if base is not None else 0
        self._vocab = len(tokenizer)

    def turn_text(self, context: str) -> str:
        """The scripted text for the next turn of `context` (the decoded prompt + response so far)."""
        head, _, tail = context.rpartition(_QUESTION_MARK)
        question = tail.split("\n", 1)[0]
        turn = tail.count(INFO_CLOSE.strip()) + tail.count(CORRECTIVE.strip())
        info = tail.rpartition(INFO_OPEN.strip())[2].partition(INFO_CLOSE.strip())[0] if INFO_OPEN.strip() in tail else ""
        searches = _SEARCH.findall(tail)
        query = searches[-1].strip() if searches else ""
        for rule in self.rules:
            if rule.match in question:
                return rule.render(rule.turns[min(turn, len(rule.turns) - 1)], question, info, query)
        raise ValueError(f"no script rule matches question {question!r}; add a rule with match ''")

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        context = str(self.tokenizer.decode(prompt_ids, skip_special_tokens=False))
        text = self.turn_text(context)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        finish = "stop" if any(text.endswith(s) for s in params.stop) else "eos"
        if finish == "eos":
            ids.append(int(self.tokenizer.eos_token_id))
        if len(ids) > params.max_new_tokens:
            ids, finish = ids[: params.max_new_tokens], "length"
        version = self.policy_version
        if self.base is not None:  # the version of the server that ran this turn (a pool's servers may differ)
            ran = await self.base.generate(prompt_ids, replace(params, max_new_tokens=len(ids), stop=()))
            version = ran.policy_version
        k = params.logprobs_k
        return Generation(
            token_ids=ids,
            logprobs=[0.0] * len(ids),
            topk_ids=[[tok] + [(tok + j) % self._vocab for j in range(1, k)] for tok in ids],
            topk_logprobs=[[0.0] + [MIN_LOGPROB] * (k - 1) for _ in ids],
            finish_reason=finish,
            policy_version=version,
        )

    def for_trajectory(self) -> ScriptedEngine:
        """This engine over the base engine's view for one trajectory (a pool keeps it on one server)."""
        base = for_trajectory(self.base) if self.base is not None else None
        if base is self.base:
            return self
        view = copy.copy(self)
        view.base = base
        return view

    async def load_weights(self, path: str, version: int) -> None:
        if self.base is not None:
            await self.base.load_weights(path, version)
        self.policy_version = version

    async def close(self) -> None:
        if self.base is not None:
            await self.base.close()
