"""Question data: loading JSONL / Search-R1 parquet rows, and a deterministic, resumable mixture sampler.

A row is `{id, question, golden_answers, data_source}` (the gateway's rollout item). Search-R1's parquet files
(scripts/data_process/nq_search.py in Search-R1) keep FlashRAG's `id`, `question`, `golden_answers` columns
next to `data_source`, `prompt`, `reward_model.ground_truth.target` and `extra_info.index`; either is read.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sisrl.common.atomic import write_jsonl


@dataclass(frozen=True)
class QAItem:
    """One question with its gold answers (the unit the gateway turns into a group of trajectories)."""

    id: str
    question: str
    golden_answers: list[str]
    data_source: str

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "question": self.question, "golden_answers": list(self.golden_answers),
                "data_source": self.data_source}


def _answers(row: dict[str, Any]) -> list[str]:
    answers = row.get("golden_answers")
    if answers is None:
        truth = (row.get("reward_model") or {}).get("ground_truth") or {}
        answers = truth.get("target")
    if isinstance(answers, str):
        answers = [answers]
    return [str(a) for a in (answers or [])]


def _question(row: dict[str, Any]) -> str:
    if row.get("question"):
        return str(row["question"]).strip()
    # Search-R1 prompt rows end their user message with "Question: <question>\n".
    prompt = row.get("prompt")
    if prompt is not None and len(prompt) > 0:
        content = str(prompt[-1]["content"])
        marker = "Question:"
        return content.rsplit(marker, 1)[-1].strip() if marker in content else content.strip()
    return ""


def row_to_item(row: dict[str, Any], *, index: int, default_source: str, where: str) -> QAItem:
    """Normalise one JSONL / parquet row; ValueError naming the file and row when a field is missing."""
    question = _question(row)
    answers = _answers(row)
    if not question:
        raise ValueError(f"{where} row {index}: no 'question' (nor a Search-R1 'prompt')")
    if not answers:
        raise ValueError(f"{where} row {index}: no 'golden_answers' (nor reward_model.ground_truth.target)")
    source = str(row.get("data_source") or default_source)
    extra = row.get("extra_info") or {}
    item_id = row.get("id")
    if item_id is None:
        item_id = f"{source}_{extra.get('index', index)}"
    return QAItem(id=str(item_id), question=question, golden_answers=answers, data_source=source)


def load_items(path: str | Path, data_source: str | None = None, limit: int | None = None) -> list[QAItem]:
    """Read a `.jsonl` or `.parquet` question file."""
    p = Path(path)
    source = data_source or p.stem
    rows: list[dict[str, Any]]
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(p).to_pylist()
    elif p.suffix in (".jsonl", ".json"):
        rows = []
        with p.open(encoding="utf-8") as fh:
            for n, line in enumerate(fh):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{p} line {n + 1}: not JSON ({err.msg})") from None
    else:
        raise ValueError(f"{p}: expected a .jsonl or .parquet file")
    if limit is not None:
        rows = rows[:limit]
    items = [row_to_item(r, index=i, default_source=source, where=str(p)) for i, r in enumerate(rows)]
    if not items:
        raise ValueError(f"{p}: no rows")
    return items


def write_items(path: str | Path, items: Sequence[QAItem]) -> None:
    """Write items as JSONL via a temp file and rename."""
    write_jsonl(Path(path), (item.to_json() for item in items))


class MixtureSampler:
    """Draws items from several sources with mixture weights; deterministic from the seed and resumable.

    Draw n picks source s with probability weight_s / sum(weights) using a RNG seeded by (seed, n), then takes
    the next item of s in an epoch-wise permutation seeded by (seed, s, epoch). The whole state is the number of
    draws and the per-source counts (`state()` / `load_state()`), so a resumed run draws the same items.
    """

    def __init__(self, sources: Sequence[Sequence[QAItem]], weights: Sequence[float], seed: int) -> None:
        if len(sources) != len(weights) or not sources:
            raise ValueError(f"need one weight per source, got {len(sources)} sources and {len(weights)} weights")
        if any(len(s) == 0 for s in sources) or any(w <= 0 for w in weights):
            raise ValueError("every source needs items and a weight > 0")
        self.sources = [list(s) for s in sources]
        total = float(sum(weights))
        self.cum: list[float] = []
        acc = 0.0
        for w in weights:
            acc += w / total
            self.cum.append(acc)
        self.seed = seed
        self.drawn = 0
        self.per_source = [0] * len(sources)
        self._perms: dict[int, tuple[int, list[int]]] = {}  # source -> (epoch, permutation), the current one

    def _perm(self, s: int, epoch: int) -> list[int]:
        cached = self._perms.get(s)
        if cached is None or cached[0] != epoch:
            order = list(range(len(self.sources[s])))
            random.Random(f"{self.seed}:{s}:{epoch}").shuffle(order)
            cached = (epoch, order)
            self._perms[s] = cached
        return cached[1]

    def next_items(self, count: int) -> list[QAItem]:
        out = []
        for _ in range(count):
            u = random.Random(f"{self.seed}:draw:{self.drawn}").random()
            s = next((i for i, c in enumerate(self.cum) if u < c), len(self.cum) - 1)
            k = self.per_source[s]
            n = len(self.sources[s])
            out.append(self.sources[s][self._perm(s, k // n)[k % n]])
            self.per_source[s] += 1
            self.drawn += 1
        return out

    def state(self) -> dict[str, Any]:
        return {"drawn": self.drawn, "per_source": list(self.per_source)}

    def load_state(self, state: dict[str, Any]) -> None:
        per_source = [int(x) for x in state["per_source"]]
        if len(per_source) != len(self.sources):
            raise ValueError(f"sampler state has {len(per_source)} sources, the config has {len(self.sources)}")
        self.drawn = int(state["drawn"])
        self.per_source = per_source
