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
    teacher: str = ""  # another person's name (multi-hop worlds only; "" in the demo's world)


def _unique(rng: random.Random, count: int, make: object, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        name = make(rng)  # type: ignore[operator]
        if name not in taken:
            taken.add(name)
            out.append(name)
    return out


def make_world(seed: int, *, people: int = 80, towns: int = 20,
               teachers: bool = False, exclude: frozenset[str] = frozenset()) -> tuple[list[Town], list[Person]]:
    """`teachers`: each person also has a teacher (another person), drawn from a separate random stream, so the
    names, towns and facts are those of the same seed without teachers. `exclude`: names not to use (another
    world's, so two worlds can share one corpus)."""
    rng = random.Random(seed)
    taken: set[str] = set(exclude)
    town_names = _unique(rng, towns, lambda r: _word(r, 1) + r.choice(["mere", "ford", "holm", "wick", "dale"]), taken)
    town_list = [Town(n, rng.choice(_REGIONS), rng.randrange(900, 1700)) for n in town_names]
    person_names = _unique(rng, people, lambda r: f"{_word(r, 2)} {_word(r, 2)}", taken)
    person_list = [Person(n, rng.randrange(1720, 1990), rng.choice(town_list), rng.choice(_OCCUPATIONS))
                   for n in person_names]
    if teachers:
        trng = random.Random(f"{seed}:teachers")
        person_list = [Person(p.name, p.born, p.town, p.occupation,
                              person_names[(i + trng.randrange(1, len(person_names))) % len(person_names)])
                       for i, p in enumerate(person_list)]
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
        if p.teacher:
            text += f" {p.name.split()[0]} was taught by {p.teacher}."
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


# The multi-hop world (bench/offpolicy.py): one, two and three hops in equal shares, so no fixed number of searches
# scores well. Each kind has two phrasings and one keyword no other kind's phrasings contain (the teacher script's
# rules match on it): "mentor" three hops, "teacher" and "founded" two, "taught", "occupation"/"for a living" and
# "born" one.
_HOP_KINDS: dict[int, tuple[tuple[str, tuple[str, str]], ...]] = {
    1: (("town", ("In which town was {} born?", "Where was {} born?")),
        ("occupation", ("What was the occupation of {}?", "What did {} do for a living?")),
        ("teacher", ("Who taught {}?", "By whom was {} taught?"))),
    2: (("year", ("In which year was the home town of {} founded?", "When was the town that {} came from founded?")),
        ("teacher_town", ("In which town was the teacher of {} born?", "Where was the teacher of {} born?"))),
    3: (("teacher_year", ("In which year was the home town of the mentor of {} founded?",
                          "When was the town that the mentor of {} came from founded?")),),
}


def multihop_questions(people: list[Person], towns: list[Town], seed: int = 0,
                       hops: tuple[int, ...] = (1, 2, 3)) -> list[QAItem]:
    """One question per person: its hop count drawn uniformly from `hops`, then a kind of that hop count and a
    phrasing. data_source "nq" for one hop and "hotpotqa" for more (both scored by EM); the id ends in `_h<hops>`."""
    rng = random.Random(f"{seed}:multihop")
    by_name = {p.name: p for p in people}
    items = []
    for i, p in enumerate(people):
        h = rng.choice(hops)
        kind, phrasings = rng.choice(_HOP_KINDS[h])
        teacher = by_name.get(p.teacher)
        if kind.startswith("teacher") and teacher is None:
            raise ValueError(f"person {p.name!r} has no teacher: build the world with make_world(..., teachers=True)")
        if kind in ("town", "occupation", "teacher"):
            answer = {"town": p.town.name, "occupation": p.occupation, "teacher": p.teacher}[kind]
        else:
            source = p if kind == "year" else teacher
            assert source is not None
            answer = source.town.name if kind == "teacher_town" else str(source.town.founded)
        items.append(QAItem(id=f"w{seed}_{i}_h{h}", question=rng.choice(phrasings).format(p.name),
                            golden_answers=[answer], data_source="nq" if h == 1 else "hotpotqa"))
    return items


_TAUGHT = r"{person} \(born \d+\) was an? [a-z]+ from [A-Z][a-z]+\. [A-Z][a-z]+ worked in the [a-z ]+ for most of " \
          r"their life\. [A-Z][a-z]+ was taught by " + _PERSON + r"\."


def multihop_teacher_script() -> dict[str, object]:
    """The scripted teacher of the multi-hop world: as `teacher_script`, plus chains through a person's teacher
    (the third search reads the teacher's name back from the second search's query)."""
    person = {"from": "question", "pattern": _PERSON}
    teacher = {"from": "info", "pattern": _TAUGHT}
    searched = {"from": "query", "pattern": "^" + _PERSON + "$"}
    teacher_town = {"from": "info",
                    "pattern": _PERSON_PASSAGE.replace("{person}", "{searched}") + r"[a-z]+ from ([A-Z][a-z]+)\."}
    town = {"from": "info", "pattern": _PERSON_PASSAGE + r"[a-z]+ from ([A-Z][a-z]+)\."}
    occupation = {"from": "info", "pattern": _PERSON_PASSAGE + r"([a-z]+) from"}
    year = {"from": "info", "pattern": r"is a small town in the [a-z ]+\. It was founded in (\d+)"}
    one_hop = {"extract": {"person": person, "town": town, "occupation": occupation, "teacher": teacher}}
    return {"rules": [
        {"match": "mentor", "extract": {"person": person, "teacher": teacher, "searched": searched,
                                        "teacher_town": teacher_town, "year": year},
         "turns": ["<search> {person} </search>", "<search> {teacher} </search>", "<search> {teacher_town} </search>",
                   "<answer> {year} </answer>"]},
        {"match": "teacher", "extract": {"person": person, "teacher": teacher, "searched": searched,
                                         "teacher_town": teacher_town},
         "turns": ["<search> {person} </search>", "<search> {teacher} </search>", "<answer> {teacher_town} </answer>"]},
        {"match": "founded", "extract": {"person": person, "town": town, "year": year},
         "turns": ["<search> {person} </search>", "<search> {town} </search>", "<answer> {year} </answer>"]},
        {**one_hop, "match": "taught", "turns": ["<search> {person} </search>", "<answer> {teacher} </answer>"]},
        {**one_hop, "match": "occupation", "turns": ["<search> {person} </search>", "<answer> {occupation} </answer>"]},
        {**one_hop, "match": "for a living", "turns": ["<search> {person} </search>", "<answer> {occupation} </answer>"]},
        {**one_hop, "match": "born", "turns": ["<search> {person} </search>", "<answer> {town} </answer>"]},
        {"match": "", "turns": ["<answer> unknown </answer>"]},
    ]}


def write_multihop_world(out: Path, *, seed: int, people: int, towns: int, test: int, dev: int,
                         transfer_seed: int | None = None, transfer_test: int = 0) -> dict[str, Path]:
    """A multi-hop world for benchmarks under `out`: corpus.jsonl, train / dev / test.jsonl (disjoint people),
    teacher.json; with `transfer_seed`, a second world (never trained on) whose passages join the same corpus and
    whose first `transfer_test` questions are transfer.jsonl. Deterministic from the seeds; returns the paths."""
    town_list, person_list = make_world(seed, people=people, towns=towns, teachers=True)
    items = multihop_questions(person_list, town_list, seed)
    if test + dev >= len(items):
        raise ValueError(f"test ({test}) + dev ({dev}) must leave train questions out of {len(items)} people")
    rows = corpus_rows(town_list, person_list)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"corpus": out / "corpus.jsonl", "train": out / "train.jsonl", "dev": out / "dev.jsonl",
             "test": out / "test.jsonl", "teacher": out / "teacher.json"}
    if transfer_seed is not None:
        taken = frozenset({p.name for p in person_list} | {t.name for t in town_list})
        t_towns, t_people = make_world(transfer_seed, people=max(transfer_test, 1), towns=towns, teachers=True,
                                       exclude=taken)
        rows += corpus_rows(t_towns, t_people)
        paths["transfer"] = out / "transfer.jsonl"
        write_items(paths["transfer"], multihop_questions(t_people, t_towns, transfer_seed)[:transfer_test])
    rows = [{"id": str(i), "contents": r["contents"]} for i, r in enumerate(rows)]
    for path, text in ((paths["corpus"], "".join(json.dumps(r) + "\n" for r in rows)),
                       (paths["teacher"], json.dumps(multihop_teacher_script(), indent=1) + "\n")):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    write_items(paths["test"], items[:test])
    write_items(paths["dev"], items[test:test + dev])
    write_items(paths["train"], items[test + dev:])
    return paths


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
