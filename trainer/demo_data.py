"""The demo data set the project makes itself: fictional people and towns, a passage corpus, and questions.

Every name is generated from syllables by a seeded RNG, so no fact can be known in advance: a policy can only
answer by searching the corpus. Deterministic from the seed. Formats: corpus JSONL `{"id", "contents"}` with
`contents = "\\"Title\\"\\ntext"` (Search-R1 / FlashRAG wiki-18), questions JSONL `{id, question,
golden_answers, data_source}`. Single-hop questions carry data_source "nq" and two-hop ones "hotpotqa": the gateway
scores a data source by its registered reward rule (EM for both), and these are the two it knows.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from sisrl.trainer.data import QAItem, write_items

_ONSETS = ["b", "br", "d", "dr", "f", "g", "gl", "k", "kr", "l", "m", "n", "p", "qu", "r", "s", "st", "t", "th",
           "v", "vr", "z", "zh"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "k", "m", "x"]
_OCCUPATIONS = ["cartographer", "glassblower", "astronomer", "clockmaker", "botanist", "shipwright", "violinist",
                "beekeeper", "architect", "weaver", "apothecary", "stonemason"]
_REGIONS = ["northern highlands", "river delta", "eastern marshes", "salt coast", "pine valley", "amber plains"]


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)).title()


@dataclass(frozen=True)
class Town:
    name: str
    region: str
    founded: int


@dataclass(frozen=True)
class Person:
    name: str
    born: int
    town: Town
    occupation: str


def _unique(rng: random.Random, count: int, make: object, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        name = make(rng)  # type: ignore[operator]
        if name not in taken:
            taken.add(name)
            out.append(name)
    return out


def make_world(seed: int, *, people: int = 80, towns: int = 20) -> tuple[list[Town], list[Person]]:
    rng = random.Random(seed)
    taken: set[str] = set()
    town_names = _unique(rng, towns, lambda r: _word(r, 1) + r.choice(["mere", "ford", "holm", "wick", "dale"]), taken)
    town_list = [Town(n, rng.choice(_REGIONS), rng.randrange(900, 1700)) for n in town_names]
    person_names = _unique(rng, people, lambda r: f"{_word(r, 2)} {_word(r, 2)}", taken)
    person_list = [Person(n, rng.randrange(1720, 1990), rng.choice(town_list), rng.choice(_OCCUPATIONS))
                   for n in person_names]
    return town_list, person_list


def _title(name: str) -> str:
    # wiki-18 convention: quoted unless the title is a single alphanumeric token
    return name if name.isalnum() else f'"{name}"'


def corpus_rows(towns: list[Town], people: list[Person]) -> list[dict[str, str]]:
    rows = []
    for t in towns:
        text = f"{t.name} is a small town in the {t.region}. It was founded in {t.founded} and is known for its market."
        rows.append(_title(t.name) + "\n" + text)
    for p in people:
        text = (f"{p.name} (born {p.born}) was a {p.occupation} from {p.town.name}. {p.name.split()[0]} worked in the "
                f"{p.town.region} for most of their life.")
        rows.append(_title(p.name) + "\n" + text)
    return [{"id": str(i), "contents": c} for i, c in enumerate(rows)]


def questions(people: list[Person]) -> list[QAItem]:
    items = []
    for i, p in enumerate(people):
        kind = i % 3
        if kind == 0:
            q, a, src = f"In which town was {p.name} born?", p.town.name, "nq"
        elif kind == 1:
            q, a, src = f"What was the occupation of {p.name}?", p.occupation, "nq"
        else:
            q, a, src = f"In which year was the home town of {p.name} founded?", str(p.town.founded), "hotpotqa"
        items.append(QAItem(id=f"demo_{i}", question=q, golden_answers=[a], data_source=src))
    return items


def write_demo_data(out: Path, *, seed: int = 0, people: int = 80, towns: int = 20, test_share: float = 0.2) -> dict[str, Path]:
    """Write corpus.jsonl, train.jsonl and test.jsonl under `out` (temp file + rename); returns their paths."""
    town_list, person_list = make_world(seed, people=people, towns=towns)
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.jsonl"
    tmp = out / ".corpus.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in corpus_rows(town_list, person_list)))
    tmp.replace(corpus)
    items = questions(person_list)
    n_test = max(1, int(len(items) * test_share))
    paths = {"corpus": corpus, "train": out / "train.jsonl", "test": out / "test.jsonl"}
    write_items(paths["train"], items[n_test:])
    write_items(paths["test"], items[:n_test])
    return paths
