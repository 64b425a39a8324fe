"""Question files (JSONL, Search-R1 parquet), the mixture sampler, `sisrl-data`, and the demo data set."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sisrl.trainer.data import MixtureSampler, QAItem, load_items
from sisrl.trainer.data_cli import main as data_main
from sisrl.trainer.demo_data import write_demo_data, write_multihop_world


def _items(prefix: str, n: int) -> list[QAItem]:
    return [QAItem(f"{prefix}{i}", f"q{i}?", [f"a{i}"], prefix) for i in range(n)]


def test_jsonl_and_errors_name_the_row(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"id": "x", "question": "Who?", "golden_answers": ["Ann"], "data_source": "nq"}\n'
                    '{"question": "Where?", "golden_answers": "Oslo"}\n')
    items = load_items(good)
    assert items[0] == QAItem("x", "Who?", ["Ann"], "nq")
    assert items[1] == QAItem("good_1", "Where?", ["Oslo"], "good")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "question": "Who?"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl row 0: no 'golden_answers'"):
        load_items(bad)


def test_search_r1_parquet_rows(tmp_path: Path) -> None:
    # Search-R1 nq_search.py rows: the FlashRAG columns are kept beside the verl ones.
    rows = [
        {"id": "train_0", "question": "who wrote hamlet?", "golden_answers": ["Shakespeare"], "data_source": "nq",
         "prompt": [{"role": "user", "content": "Answer... Question: who wrote hamlet?\n"}],
         "reward_model": {"style": "rule", "ground_truth": {"target": ["Shakespeare"]}},
         "extra_info": {"split": "train", "index": 0}},
    ]
    slim = [{"data_source": "hotpotqa", "prompt": [{"role": "user", "content": "Rules. Question: Which is older?\n"}],
             "reward_model": {"style": "rule", "ground_truth": {"target": ["A", "B"]}},
             "extra_info": {"split": "train", "index": 7}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "full.parquet")
    pq.write_table(pa.Table.from_pylist(slim), tmp_path / "slim.parquet")
    assert load_items(tmp_path / "full.parquet") == [QAItem("train_0", "who wrote hamlet?", ["Shakespeare"], "nq")]
    assert load_items(tmp_path / "slim.parquet") == [QAItem("hotpotqa_7", "Which is older?", ["A", "B"], "hotpotqa")]


def test_sampler_is_deterministic_resumable_and_weighted() -> None:
    sources, weights = [_items("a", 7), _items("b", 5)], [3.0, 1.0]
    whole = MixtureSampler(sources, weights, seed=1)
    draws = [it.id for it in whole.next_items(400)]
    first = MixtureSampler(sources, weights, seed=1)
    head = [it.id for it in first.next_items(150)]
    resumed = MixtureSampler(sources, weights, seed=1)
    resumed.load_state(json.loads(json.dumps(first.state())))
    assert head + [it.id for it in resumed.next_items(250)] == draws
    share_a = sum(d.startswith("a") for d in draws) / len(draws)
    assert 0.68 <= share_a <= 0.82  # weight 3:1 -> 0.75; binomial sd at n=400 is 0.022
    counts = Counter(d for d in draws[:70] if d.startswith("a"))
    assert max(counts.values()) - min(counts.values()) <= 1  # epochs: every item once before any repeats
    assert [it.id for it in MixtureSampler(sources, weights, seed=2).next_items(50)] != draws[:50]


def test_prepare_converts_local_flashrag_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "flashrag"
    for name, split in [("nq", "train"), ("nq", "test")]:
        (src / name).mkdir(parents=True, exist_ok=True)
        (src / name / f"{split}.jsonl").write_text(
            "".join(json.dumps({"id": f"{split}_{i}", "question": f"q{i}", "golden_answers": [f"a{i}"],
                                "metadata": {}}) + "\n" for i in range(3)))
    assert data_main(["prepare", "--out", str(tmp_path / "out"), "--datasets", "nq", "--from-dir", str(src),
                      "--limit", "2"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "out" / "nq_test.jsonl").read_text().splitlines()]
    assert rows == [{"id": f"test_{i}", "question": f"q{i}", "golden_answers": [f"a{i}"], "data_source": "nq"}
                    for i in range(2)]
    assert "nq_train.jsonl: 2 rows" in capsys.readouterr().out


def test_prepare_offline_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert data_main(["prepare", "--out", str(tmp_path)]) == 2
    assert "cannot download NQ / HotpotQA: HF_HUB_OFFLINE is set" in capsys.readouterr().err


def test_demo_data_is_deterministic_and_answers_need_the_corpus(tmp_path: Path) -> None:
    a = write_demo_data(tmp_path / "a", seed=3)
    b = write_demo_data(tmp_path / "b", seed=3)
    c = write_demo_data(tmp_path / "c", seed=4)
    assert a["corpus"].read_text() == b["corpus"].read_text() != c["corpus"].read_text()
    corpus = [json.loads(x)["contents"] for x in a["corpus"].read_text().splitlines()]
    items = load_items(a["train"]) + load_items(a["test"])
    assert {it.data_source for it in items} == {"nq", "hotpotqa"}
    for it in items:  # every gold answer is written in some passage
        assert any(it.golden_answers[0] in text for text in corpus), it
    assert not set(x.id for x in load_items(a["train"])) & set(x.id for x in load_items(a["test"]))


def test_multihop_world_mixes_hops_keeps_splits_apart_and_leaves_the_demo_world_alone(tmp_path: Path) -> None:
    before = write_demo_data(tmp_path / "demo", seed=0)["corpus"].read_text()
    paths = write_multihop_world(tmp_path / "mh", seed=0, people=240, towns=12, test=90, dev=30, transfer_seed=1,
                                 transfer_test=40)
    split = {name: [json.loads(line) for line in paths[name].read_text().splitlines()]
             for name in ("train", "dev", "test", "transfer")}
    assert [len(split[n]) for n in ("train", "dev", "test", "transfer")] == [120, 30, 90, 40]
    hops = [q["id"].rsplit("_h", 1)[1] for q in split["test"]]
    assert min(hops.count(h) for h in "123") >= 20  # about a third each
    people = {name: {re.search(r"[A-Z][a-z]+ [A-Z][a-z]+", q["question"]).group(0) for q in split[name]}  # type: ignore[union-attr]
              for name in ("train", "dev", "test")}
    assert not people["train"] & people["test"] and not people["dev"] & people["test"]
    corpus = paths["corpus"].read_text()
    for q in split["transfer"][:5]:  # the transfer world's passages are in the shared corpus, under new names
        assert q["golden_answers"][0] in corpus
    assert "was taught by" in corpus
    assert "taught by" not in before  # the demo's world (and its teacher) are unchanged
