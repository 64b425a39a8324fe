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


# Two phrasings per kind of question (picked per person by the seed), so a policy cannot key on one template.
_PHRASINGS = (
    ("In which town was {} born?", "Where was {} born?"),
    ("What was the occupation of {}?", "What did {} do for a living?"),
    ("In which year was the home town of {} founded?", "When was the town that {} came from founded?"),
)


def questions(people: list[Person], seed: int = 0) -> list[QAItem]:
    """Per person i: kind i % 3 (birth town and occupation: one hop, "nq"; founding year of the home town:
    two hops, "hotpotqa"), in one of two phrasings."""
    rng = random.Random(f"{seed}:phrasing")
    items = []
    for i, p in enumerate(people):
        kind = i % 3
        template = rng.choice(_PHRASINGS[kind])
        answer = (p.town.name, p.occupation, str(p.town.founded))[kind]
        items.append(QAItem(id=f"demo_{i}", question=template.format(p.name), golden_answers=[answer],
                            data_source="hotpotqa" if kind == 2 else "nq"))
    return items


_PERSON = r"([A-Z][a-z]+ [A-Z][a-z]+)"  # generated names are two capitalised words; nothing else in a question is
_PERSON_PASSAGE = r"{person} \(born \d+\) was an? "


def teacher_script() -> dict[str, object]:
    """The scripted engine's teacher for this world (services/scripted.py, teacher mode): search the person,
    read the answer (or the home town, then search it and read its founding year) from the passages the
    retriever returned, and answer; `fallback` (a wrong answer, filtered out by reward) when they lack it."""
    person = {"from": "question", "pattern": _PERSON}
    town = {"from": "info", "pattern": _PERSON_PASSAGE + r"[a-z]+ from ([A-Z][a-z]+)\."}
    occupation = {"from": "info", "pattern": _PERSON_PASSAGE + r"([a-z]+) from"}
    year = {"from": "info", "pattern": r"is a small town in the [a-z ]+\. It was founded in (\d+)"}
    one_hop = {"match": "", "extract": {"person": person, "town": town, "occupation": occupation}}
    return {"rules": [
        {"match": "founded", "extract": {"person": person, "town": town, "year": year},
         "turns": ["<search> {person} </search>", "<search> {town} </search>", "<answer> {year} </answer>"]},
        {**one_hop, "match": "occupation", "turns": ["<search> {person} </search>", "<answer> {occupation} </answer>"]},
        {**one_hop, "match": "for a living", "turns": ["<search> {person} </search>", "<answer> {occupation} </answer>"]},
        {**one_hop, "match": "born", "turns": ["<search> {person} </search>", "<answer> {town} </answer>"]},
        {"match": "", "turns": ["<answer> unknown </answer>"]},
    ]}


def write_demo_data(out: Path, *, seed: int = 0, people: int = 80, towns: int = 20, test_share: float = 0.2) -> dict[str, Path]:
    """Write corpus.jsonl, train.jsonl (and its per-source parts train_nq / train_hotpotqa), test.jsonl and
    teacher.json (the scripted teacher) under `out` (temp file + rename); returns their paths."""
    town_list, person_list = make_world(seed, people=people, towns=towns)
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.jsonl"
    tmp = out / ".corpus.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in corpus_rows(town_list, person_list)))
    tmp.replace(corpus)
    items = questions(person_list, seed)
    n_test = max(1, int(len(items) * test_share))
    paths = {"corpus": corpus, "train": out / "train.jsonl", "test": out / "test.jsonl",
             "teacher": out / "teacher.json"}
    tmp = out / ".teacher.json.tmp"
    tmp.write_text(json.dumps(teacher_script(), indent=1) + "\n")
    tmp.replace(paths["teacher"])
    write_items(paths["train"], items[n_test:])
    write_items(paths["test"], items[:n_test])
    for source in ("nq", "hotpotqa"):  # per-source train files: the RL mixture can weight two-hop questions
        paths[f"train_{source}"] = out / f"train_{source}.jsonl"
        write_items(paths[f"train_{source}"], [it for it in items[n_test:] if it.data_source == source])
    return paths
