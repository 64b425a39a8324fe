"""`python -m sisrl.trainer.crossworld` on a small world: its own data, index, retriever and gateway (real
processes), a policy evaluated on questions whose facts it cannot know."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from sisrl.common.models import build_tiny_policy, load_tokenizer
from sisrl.trainer.crossworld import main
from sisrl.trainer.demo_data import write_demo_data

SMALL = ["--people", "15", "--towns", "4", "--encoder", "minilm"]


def test_the_teacher_then_a_checkpoint_on_an_unseen_world(tmp_path: Path) -> None:
    # The scripted teacher knows no world: it reads the question and the passages the retriever returns.
    workdir = tmp_path / "w7"
    assert main(["--script", "--seed", "7", "--workdir", str(workdir), *SMALL]) == 0
    teacher = json.loads((workdir / "eval.json").read_text())
    assert teacher["seed"] == 7 and set(teacher["em_by_source"]) == {"nq", "hotpotqa"}
    assert teacher["em"] >= 0.5 and teacher["searches_per_traj"] >= 1.0
    assert (teacher["settings"]["max_turns"], teacher["settings"]["max_new_tokens"]) == (3, 24)  # the demo's
    train_world = write_demo_data(tmp_path / "w0", seed=0, people=15, towns=4)["corpus"].read_text()
    assert (workdir / "data" / "corpus.jsonl").read_text() != train_world  # other people, other facts

    # A checkpoint on the same world and workdir: the index is reused, the teacher's stored batch is not.
    index_built = (workdir / "index" / "manifest.json").stat().st_mtime_ns
    ckpt = tmp_path / "ckpt"
    tokenizer = load_tokenizer()
    build_tiny_policy(tokenizer, seed=0).save_pretrained(ckpt, safe_serialization=True)
    tokenizer.save_pretrained(ckpt)
    torch.set_num_threads(1)
    argv = ["--checkpoint", str(ckpt), "--seed", "7", "--workdir", str(workdir), "--limit", "3",
            "--max-new-tokens", "6", "--max-turns", "1", *SMALL]
    assert main(argv) == 0
    result = json.loads((workdir / "eval.json").read_text())
    assert (workdir / "index" / "manifest.json").stat().st_mtime_ns == index_built
    assert result["policy"] == str(ckpt) and result["settings"]["max_turns"] == 1  # the flag wins
    # six random tokens in one turn cannot search or answer: a replay of the teacher's batch would
    assert result["searches_per_traj"] == 0.0 and result["em"] == 0.0, result
