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


def test_a_policy_that_searches_and_reads_scores_on_an_unseen_world(tmp_path: Path) -> None:
    # The scripted teacher knows no world: it reads the question and the passages the retriever returns.
    assert main(["--script", "--seed", "7", "--workdir", str(tmp_path / "w7"), *SMALL]) == 0
    result = json.loads((tmp_path / "w7" / "eval.json").read_text())
    assert result["seed"] == 7 and set(result["em_by_source"]) == {"nq", "hotpotqa"}
    assert result["em"] >= 0.5 and result["searches_per_traj"] >= 1.0
    train_world = write_demo_data(tmp_path / "w0", seed=0, people=15, towns=4)["corpus"].read_text()
    assert (tmp_path / "w7" / "data" / "corpus.jsonl").read_text() != train_world  # other people, other facts


def test_a_checkpoint_is_evaluated_on_the_other_world(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    tokenizer = load_tokenizer()
    build_tiny_policy(tokenizer, seed=0).save_pretrained(ckpt, safe_serialization=True)
    tokenizer.save_pretrained(ckpt)
    torch.set_num_threads(1)
    argv = ["--checkpoint", str(ckpt), "--seed", "3", "--workdir", str(tmp_path / "w3"), "--limit", "3",
            "--max-new-tokens", "6", "--max-turns", "1", *SMALL]
    assert main(argv) == 0
    result = json.loads((tmp_path / "w3" / "eval.json").read_text())
    assert result["policy"] == str(ckpt) and 0.0 <= result["em"] <= 1.0  # a random tiny policy: no claim on EM
    assert (tmp_path / "w3" / "index" / "manifest.json").is_file()
