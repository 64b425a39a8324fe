"""A scripted policy: the benchmark's workload driver and a deterministic engine for protocol tests.

The script fixes the text of each turn per question (rules match a substring of the question; the first match
wins, an empty `match` is the default). The policy is deterministic, so log q of every emitted token is 0.0;
its top-K row is the emitted token at 0.0 followed by K-1 other ids at MIN_LOGPROB (log 0, floored).
With `base`, every turn first runs the real engine on the real context for as many tokens as the scripted turn
has (stop strings off), so engine time and batching are those of the real engine while the turn counts follow
the script. Script file (JSON): `{"rules": [{"match": "capital", "turns": ["<search>x</search>", "..."]}]}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from sisrl.services.agent import CORRECTIVE, INFO_CLOSE
from sisrl.services.engines.base import MIN_LOGPROB, Engine, Generation, SamplingParams
from transformers import PreTrainedTokenizerBase

_QUESTION_MARK = "\nQuestion: "


@dataclass(frozen=True)
class ScriptRule:
    match: str
    turns: tuple[str, ...]


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
        out.append(ScriptRule(match=str(rule.get("match", "")), turns=tuple(turns)))
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
        for rule in self.rules:
            if rule.match in question:
                return rule.turns[min(turn, len(rule.turns) - 1)]
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
        if self.base is not None:
            await self.base.generate(prompt_ids, replace(params, max_new_tokens=len(ids), stop=()))
        k = params.logprobs_k
        return Generation(
            token_ids=ids,
            logprobs=[0.0] * len(ids),
            topk_ids=[[tok] + [(tok + j) % self._vocab for j in range(1, k)] for tok in ids],
            topk_logprobs=[[0.0] + [MIN_LOGPROB] * (k - 1) for _ in ids],
            finish_reason=finish,
            policy_version=self.policy_version,
        )

    async def load_weights(self, path: str, version: int) -> None:
        if self.base is not None:
            await self.base.load_weights(path, version)
        self.policy_version = version

    async def close(self) -> None:
        if self.base is not None:
            await self.base.close()
