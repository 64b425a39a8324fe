"""Rewards for search-agent rollouts: exact match (EM) after SQuAD normalisation, token F1, a format reward.

Normalisation follows the SQuAD v1.1 evaluation script (lower case, drop punctuation, drop the articles
a/an/the, fold whitespace), the rule Search-R1 and verl's `qa_em` use. The answer is taken from the text the
policy sampled (the response), never from the prompt, whose instructions contain an example answer tag.
The reward rule is chosen per data source; an unknown source is refused with the list of known ones.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)
METRICS = ("em", "f1")


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    text = _ARTICLES_RE.sub(" ", text)
    return " ".join(text.split())


def extract_answer(response_text: str) -> str | None:
    """The content of the last complete `<answer>...</answer>` in the response, stripped; None when absent."""
    matches = _ANSWER_RE.findall(response_text)
    return matches[-1].strip() if matches else None


def exact_match(prediction: str, golden_answers: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return 1.0 if any(pred == normalize_answer(gold) for gold in golden_answers) else 0.0


def f1_score(prediction: str, golden_answers: Sequence[str]) -> float:
    """Best token-level F1 (SQuAD definition) of the prediction against any gold answer."""
    pred_tokens = normalize_answer(prediction).split()
    best = 0.0
    for gold in golden_answers:
        gold_tokens = normalize_answer(gold).split()
        common = Counter(pred_tokens) & Counter(gold_tokens)
        overlap = sum(common.values())
        if overlap == 0:
            continue
        precision = overlap / len(pred_tokens)
        recall = overlap / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


@dataclass(frozen=True)
class RewardSpec:
    """How one data source is scored: `metric` (em | f1) plus `format_weight` times the format score."""

    metric: str = "em"
    format_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"RewardSpec.metric: unknown metric {self.metric!r}, expected one of {METRICS}")
        if not 0.0 <= self.format_weight <= 1.0:
            raise ValueError(f"RewardSpec.format_weight: expected a value in [0, 1], got {self.format_weight}")


# Search-R1 scores its QA sources with EM on the final answer (verl `qa_em`); F1 is reported as a metric.
# nq and hotpotqa are this project's sources; the others are Search-R1's evaluation sets.
DEFAULT_SPECS: dict[str, RewardSpec] = {
    name: RewardSpec()
    for name in ("nq", "hotpotqa", "triviaqa", "popqa", "2wikimultihopqa", "musique", "bamboogle")
}


@dataclass(frozen=True)
class RewardResult:
    """The extracted answer, the scalar reward and its parts."""

    answer: str | None
    reward: float
    em: float
    f1: float
    format: float


def reward_spec(data_source: str, specs: dict[str, RewardSpec] | None = None) -> RewardSpec:
    """The spec registered for `data_source`; ValueError naming the known sources otherwise."""
    table = DEFAULT_SPECS if specs is None else specs
    if data_source not in table:
        raise ValueError(f"unknown data_source {data_source!r}, expected one of {sorted(table)}")
    return table[data_source]


def score_response(
    *,
    turn_texts: Sequence[str],
    valid_actions: int,
    golden_answers: Sequence[str],
    spec: RewardSpec,
) -> RewardResult:
    """Score one trajectory from the texts the policy sampled, one per turn.

    format = 1 when every sampled turn was a valid action and the last one gave an answer, else 0.
    reward = (1 - format_weight) * metric + format_weight * format.
    """
    answer = extract_answer("".join(turn_texts))
    em = exact_match(answer, golden_answers) if answer is not None else 0.0
    f1 = f1_score(answer, golden_answers) if answer is not None else 0.0
    last_answers = bool(turn_texts) and extract_answer(turn_texts[-1]) is not None
    fmt = 1.0 if last_answers and valid_actions == len(turn_texts) else 0.0
    metric = em if spec.metric == "em" else f1
    reward = (1.0 - spec.format_weight) * metric + spec.format_weight * fmt
    return RewardResult(answer=answer, reward=reward, em=em, f1=f1, format=fmt)
