"""The scripted engine's teacher mode: values read from the question and the inserted passages, and the fallback
when the passages lack the evidence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sisrl.common.models import load_tokenizer
from sisrl.services.agent import INFO_CLOSE, INFO_OPEN
from sisrl.services.scripted import ScriptedEngine, load_script
from sisrl.trainer.demo_data import multihop_teacher_script, teacher_script

PASSAGE = "Doc 1(Title: Mira Tolk) Mira Tolk (born 1801) was a weaver from Dalmere. Mira worked in the pine valley.\n"
TOWN = "Doc 1(Title: Dalmere) Dalmere is a small town in the pine valley. It was founded in 1234 and is known.\n"


def _engine(tmp_path: Path) -> ScriptedEngine:
    path = tmp_path / "teacher.json"
    path.write_text(json.dumps(teacher_script()))
    return ScriptedEngine(load_tokenizer(), load_script(path))


def _context(question: str, *observations: str) -> str:
    turns = "".join(f"<search> x </search>{INFO_OPEN}{obs}{INFO_CLOSE}" for obs in observations)
    return f"<|im_start|>user\nInstructions.\nQuestion: {question}\n<|im_end|>\n<|im_start|>assistant\n{turns}"


def test_two_hop_teacher_reads_each_hop_from_the_passages(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    question = "In which year was the home town of Mira Tolk founded?"
    assert engine.turn_text(_context(question)) == "<search> Mira Tolk </search>"
    assert engine.turn_text(_context(question, PASSAGE)) == "<search> Dalmere </search>"
    assert engine.turn_text(_context(question, PASSAGE, TOWN)) == "<answer> 1234 </answer>"


def test_one_hop_teacher_answers_only_from_the_right_persons_passage(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    assert engine.turn_text(_context("What did Mira Tolk do for a living?", PASSAGE)) == "<answer> weaver </answer>"
    assert engine.turn_text(_context("Where was Mira Tolk born?", PASSAGE)) == "<answer> Dalmere </answer>"
    # the retriever returned someone else's passage: no evidence, so the fallback (reward 0, filtered out)
    other = PASSAGE.replace("Mira Tolk", "Kel Brun")
    assert engine.turn_text(_context("Where was Mira Tolk born?", other)) == "<answer> unknown </answer>"


def test_three_hop_teacher_follows_the_teacher_chain_and_reads_its_name_back_from_the_query(tmp_path: Path) -> None:
    path = tmp_path / "multihop.json"
    path.write_text(json.dumps(multihop_teacher_script()))
    engine = ScriptedEngine(load_tokenizer(), load_script(path))
    student = PASSAGE.replace("pine valley.", "pine valley for most of their life. Mira was taught by Oru Vell.")
    teacher = ("Doc 1(Title: Oru Vell) Oru Vell (born 1770) was a glassblower from Kenford. Oru worked in the salt "
               "coast for most of their life. Oru was taught by Mira Tolk.\n")
    town = TOWN.replace("Dalmere", "Kenford").replace("1234", "1111")
    question = "In which year was the home town of the mentor of Mira Tolk founded?"

    def turn(*steps: tuple[str, str]) -> str:
        body = "".join(f"<search> {q} </search>{INFO_OPEN}{obs}{INFO_CLOSE}" for q, obs in steps)
        return engine.turn_text(f"<|im_start|>user\nI.\nQuestion: {question}\n<|im_end|>\n<|im_start|>assistant\n{body}")

    assert turn() == "<search> Mira Tolk </search>"
    assert turn(("Mira Tolk", student)) == "<search> Oru Vell </search>"
    # the teacher's passage names the student too: the town is the searched person's, read back from the query
    assert turn(("Mira Tolk", student), ("Oru Vell", teacher + student)) == "<search> Kenford </search>"
    assert turn(("Mira Tolk", student), ("Oru Vell", teacher), ("Kenford", town)) == "<answer> 1111 </answer>"
    two_hop = "Where was the teacher of Mira Tolk born?"
    question = two_hop
    assert turn(("Mira Tolk", student), ("Oru Vell", teacher)) == "<answer> Kenford </answer>"
    question = "Who taught Mira Tolk?"
    assert turn(("Mira Tolk", student)) == "<answer> Oru Vell </answer>"


def test_bad_teacher_scripts_name_the_entry(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"rules": [{"turns": ["a"], "extract": {"x": {"from": "web", "pattern": "(a)"}}}]}))
    with pytest.raises(ValueError, match=r"rules\[0\]\.extract\.x: expected"):
        load_script(path)
    path.write_text(json.dumps({"rules": [{"turns": ["a"], "extract": {"x": {"from": "info", "pattern": "a"}}}]}))
    with pytest.raises(ValueError, match="needs one capture group"):
        load_script(path)
    path.write_text(json.dumps({"rules": [{"turns": ["<answer> {y} </answer>"]}]}))
    engine = ScriptedEngine(load_tokenizer(), load_script(path))
    with pytest.raises(ValueError, match=r"uses \{y\}, which no extract defines"):
        engine.turn_text(_context("q?"))
