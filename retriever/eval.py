"""Retrieval quality on a question set: recall@k of gold passage ids and answer-string recall@k.

Questions are JSONL `{"question": str, "golden_answers": [str], "metadata": {"gold_passage_ids": [str]}}`
(the layout of ../shared/data/{nq,hotpotqa}/dev.jsonl). recall@k (gold) = share of questions with gold ids
that have at least one gold passage among the top k; answer recall@k = share of questions with answers whose
top k hold at least one answer string, both sides SQuAD-normalised (docs/design.md, "Reward").
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sisrl.retriever.corpus import Passage

_PUNCTUATION = frozenset(string.punctuation)
RetrieveFn = Callable[[list[str], int], list[list[Passage]]]


@dataclass(frozen=True)
class Question:
    question: str
    answers: tuple[str, ...]
    gold_ids: tuple[str, ...]


@dataclass(frozen=True)
class EvalReport:
    questions: int
    with_gold: int
    with_answers: int
    gold_recall: dict[int, float]
    answer_recall: dict[int, float]

    def as_dict(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {"questions": self.questions, "with_gold": self.with_gold,
                                       "with_answers": self.with_answers}
        out.update({f"eval/gold_recall@{k}": v for k, v in self.gold_recall.items()})
        out.update({f"eval/answer_recall@{k}": v for k, v in self.answer_recall.items()})
        return out


def load_questions(path: Path, limit: int | None = None) -> list[Question]:
    """Read a question file; a line without a string `question` is an error naming its line number."""
    questions: list[Question] = []
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from exc
            if not isinstance(obj, dict) or not isinstance(obj.get("question"), str):
                raise ValueError(f"{path}:{line_no}: expected an object with a string 'question'")
            metadata = obj.get("metadata") or {}
            questions.append(Question(question=obj["question"],
                                      answers=tuple(str(a) for a in obj.get("golden_answers") or ()),
                                      gold_ids=tuple(str(i) for i in metadata.get("gold_passage_ids") or ())))
            if limit is not None and len(questions) >= limit:
                break
    return questions


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation and articles, fold whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def evaluate(questions: Sequence[Question], retrieve: RetrieveFn, ks: Sequence[int] = (1, 3, 10),
             batch_size: int = 256) -> EvalReport:
    """Retrieve max(ks) passages per question in batches and score every k from the same ranking."""
    if not questions:
        raise ValueError("no questions to evaluate")
    if not ks or min(ks) < 1:
        raise ValueError(f"ks must be positive ranks, got {list(ks)}")
    k_max = max(ks)
    gold_hits = dict.fromkeys(ks, 0)
    answer_hits = dict.fromkeys(ks, 0)
    for start in range(0, len(questions), batch_size):
        chunk = questions[start:start + batch_size]
        ranked = retrieve([q.question for q in chunk], k_max)
        for question, passages in zip(chunk, ranked, strict=True):
            gold_rank, answer_rank = _gold_rank(question, passages), _answer_rank(question, passages)
            for k in ks:
                gold_hits[k] += gold_rank is not None and gold_rank < k
                answer_hits[k] += answer_rank is not None and answer_rank < k
    with_gold = sum(1 for q in questions if q.gold_ids)
    with_answers = sum(1 for q in questions if q.answers)
    return EvalReport(questions=len(questions), with_gold=with_gold, with_answers=with_answers,
                      gold_recall={k: gold_hits[k] / with_gold if with_gold else float("nan") for k in ks},
                      answer_recall={k: answer_hits[k] / with_answers if with_answers else float("nan") for k in ks})


def _gold_rank(question: Question, passages: Sequence[Passage]) -> int | None:
    """0-based rank of the first gold passage, None when there is none (or no gold ids)."""
    return next((rank for rank, p in enumerate(passages) if p.id in question.gold_ids), None)


def _answer_rank(question: Question, passages: Sequence[Passage]) -> int | None:
    """0-based rank of the first passage holding a (normalised) gold answer, None when none does."""
    answers = [a for a in (normalize_answer(x) for x in question.answers) if a]
    if not answers:
        return None
    return next((rank for rank, p in enumerate(passages) if any(a in normalize_answer(p.contents) for a in answers)),
                None)


def http_retrieve(url: str, token: str | None = None, timeout: float = 600.0) -> RetrieveFn:
    """A RetrieveFn that asks a running server (`.../retrieve`) with Search-R1's request body."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}

    def retrieve(queries: list[str], k: int) -> list[list[Passage]]:
        response = httpx.post(url, json={"queries": queries, "topk": k, "return_scores": True},
                              headers=headers, timeout=timeout)
        response.raise_for_status()
        return [[Passage(id=str(item["document"]["id"]), contents=item["document"]["contents"]) for item in row]
                for row in response.json()["result"]]

    return retrieve
