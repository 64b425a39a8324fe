"""bench/offpolicy.py end to end on a tiny multi-hop world with the tiny policy: the real retriever and gateway
as processes, the scripted teacher, SFT, 2 ratios x 2 N x 2 seeds of one RL step, the runs ledger, the record
with its table and paired differences, the figure beside it; a rerun that trains nothing twice; and one
asynchronous cell (the k axis) with its lag in the ledger."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sisrl.common.models import build_tiny_policy, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _bench(args: list[str], cwd: Path) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "offpolicy.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.timeout(300)  # ~100 s on a quiet 2-core CPU: SFT, 9 runs of the tiny policy, two evaluations each
def test_the_bench_runs_end_to_end_and_writes_its_record_and_figure(tmp_path: Path) -> None:
    tokenizer = load_tokenizer()
    policy = tmp_path / "policy"
    build_tiny_policy(tokenizer, seed=0).save_pretrained(policy, safe_serialization=True)
    tokenizer.save_pretrained(policy)
    results = tmp_path / "results"
    args = ["--axes", "N", "--ns", "1", "2", "--ratios", "is", "sis", "--seeds", "0", "1", "--steps", "1",
            "--prompts", "2", "--samples", "2", "--people", "30", "--towns", "5", "--test", "8", "--dev", "4",
            "--transfer", "4", "--sft-demos", "8", "--trainable-layers", "0", "--policy", str(policy), "--encoder", "minilm",
            "--workdir", str(tmp_path / "work"), "--results-dir", str(results), "--lr", "1e-3", "--exact"]
    out = _bench(args, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "work" / "runs.jsonl").read_text().splitlines()]
    # the on-policy cell once (plain IS), then each ratio at N = 2, and exact SIS (K = V) beside SIS at K = 20
    cells = [("is", 1, 20), ("is", 2, 20), ("sis", 2, 20), ("sis", 2, 0)]
    assert sorted((r["ratio"], r["n"], r["topk"], r["seed"]) for r in rows) == sorted(
        (*cell, seed) for cell in cells for seed in (0, 1))
    for r in rows:
        assert r["steps"] == 1 and 0.0 <= r["test_em"] <= 1.0 and 0.0 <= r["transfer_em"] <= 1.0
        assert r["wall_s"] > 0 and r["eval_s"] > 0  # training and the evaluation of both splits, timed apart
        assert r["accept"] is not None and r["D"] is not None and r["ess"] is not None
    records = sorted((results / "offpolicy").glob("*.json"))
    assert len(records) == 1, out
    record = json.loads(records[0].read_text())
    cols, table = record["table"]["columns"], record["table"]["rows"]
    assert len(table) == 4
    paired, n = cols.index("SIS - this (paired)"), cols.index("N")
    assert [row[paired] is not None for row in table] == [row[0] == "is" and row[n] == 2 for row in table]
    exact = [row for row in table if row[cols.index("K")] == "V"]
    assert len(exact) == 1 and exact[0][cols.index("xi_K")] == 0.0
    assert records[0].with_suffix(".png").stat().st_size > 1000
    beside = [json.loads(line) for line in records[0].with_suffix(".runs.jsonl").read_text().splitlines()]
    assert sorted(r["key"] for r in beside) == sorted(r["key"] for r in rows)  # the table's runs kept with it
    again = _bench(args + ["--no-record"], tmp_path)  # resumable: nothing left to run
    assert "0 runs to do" in again
    plan = _bench(args + ["--plan", "--seeds", "0", "1", "2"], tmp_path)  # a third seed: what is left and its time
    assert "12 runs in all, 8 done, 4 to do: ~" in plan and "a run (measured here)" in plan, plan
    assert len((tmp_path / "work" / "runs.jsonl").read_text().splitlines()) == len(rows)

    # the k axis: one asynchronous cell (lag bound 2) on the same world and warm start, its row in the ledger
    _bench(args + ["--axes", "k", "--ks", "2", "--ratios", "sis", "--seeds", "0", "--steps", "3", "--no-record"],
           tmp_path)
    (lagged,) = [json.loads(line) for line in (tmp_path / "work" / "runs.jsonl").read_text().splitlines()
                 if json.loads(line)["k"] == 2]
    assert (lagged["ratio"], lagged["n"], lagged["steps"]) == ("sis", 1, 3), lagged
    assert lagged["lag_mean"] is not None and 0.0 <= lagged["lag_mean"] <= 2.0, lagged
    assert lagged["accept"] is not None and 0.0 <= lagged["test_em"] <= 1.0, lagged


def _offpolicy() -> Any:
    sys.path.insert(0, str(ROOT / "bench"))  # bench/offpolicy.py imports its neighbour `record` by that name
    try:
        import offpolicy
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return offpolicy


def test_the_default_grid_is_the_headline_and_all_is_every_axis() -> None:
    """The budget: with no options the grid is the headline table (the on-policy cell once, every ratio at
    N = 16, five seeds); `--axes all` adds N = 4 and 8, the lag and K axes; exact SIS joins the N axis on ask."""
    offpolicy = _offpolicy()
    args = offpolicy.parse_args([])
    cells = offpolicy.grid(args, 1e-4)
    assert (args.seeds, args.ns) == ([0, 1, 2, 3, 4], [1, 16])
    assert sorted((c.ratio, c.n, c.k, c.topk) for c in cells) == sorted(
        [("is", 1, 0, 20)] + [(r, 16, 0, 20) for r in offpolicy.RATIOS])
    every = offpolicy.grid(offpolicy.parse_args(["--axes", "all"]), 1e-4)
    assert {c.n for c in every} == {1, 4, 8, 16} and {c.k for c in every} >= {0, 2, 4, 8}
    assert {c.topk for c in every if c.ratio == "sis"} == {1, 5, 20, 100, 0}
    exact = offpolicy.grid(offpolicy.parse_args(["--exact"]), 1e-4)
    assert set(exact) - set(cells) == {offpolicy.Cell("sis", n=16, topk=0, lr=1e-4)}


def test_the_plan_prices_an_asynchronous_run_apart() -> None:
    """An async run trains longer (its steps wait for lagged rollouts): the hours left use each kind's own cost."""
    offpolicy = _offpolicy()
    rows = [{"k": 0, "wall_s": 100.0, "eval_s": 200.0}, {"k": 2, "wall_s": 700.0, "eval_s": 400.0}]
    sync, lagged = offpolicy.Cell("is", n=16), offpolicy.Cell("is", k=2)
    # evaluation: the mean of every timed run (300 s); training: the kind's own (100 s, 700 s)
    assert offpolicy.cell_cost(rows, sync) == 400.0 and offpolicy.cell_cost(rows, lagged) == 1000.0
    assert offpolicy.eta(rows, [sync, sync, lagged]) == "~30 min at 10 min a run (measured here)"
    assert offpolicy.eta([], [sync]) == ""


def test_the_best_ratio_of_a_cell_names_a_tie() -> None:
    offpolicy = _offpolicy()

    def entry(ratio: str, em: float) -> dict[str, object]:
        return {"ratio": ratio, "topk": 20, "em": em}

    assert offpolicy.best_ratio([entry("is", 0.4), entry("sis", 0.5)]) == "sis"
    assert offpolicy.best_ratio([entry("is", 0.0), entry("sis", 0.0), entry("tis", -0.0)]) == \
        "a tie at 0.000 (is, sis, tis)"


def test_the_figure_has_a_precision_panel_where_the_grid_has_a_bf16_engine(tmp_path: Path) -> None:
    """The precision axis alone (N = 1, a bf16 engine against the fp32 reference) is drawn (it has no N or k to
    vary); one cell alone is nothing to draw."""
    offpolicy = _offpolicy()

    def entry(ratio: str, engine: str) -> dict[str, object]:
        return {"ratio": ratio, "n": 1, "k": 0, "engine": engine, "topk": 20, "em": 0.5, "em_ci": 0.05, "seeds": 5}

    ref = entry("is", "float32")
    assert offpolicy.figure([ref], 0.5, tmp_path / "one.png") is None
    png = offpolicy.figure([ref, entry("is", "bfloat16"), entry("sis", "bfloat16")], 0.5, tmp_path / "bf16.png")
    assert png is not None and png.stat().st_size > 1000


def test_the_k_ablation_is_a_sentence_a_table_order_and_a_panel(tmp_path: Path) -> None:
    """The referee's question (does the residual mass xi_K matter?): SIS at each K beside K = 20, paired over the
    same seeds, in the record's sentences and figures, the table (exact first, then K down) and a panel of its own."""
    offpolicy = _offpolicy()
    em = {1: [0.25, 0.20, 0.26], 5: [0.50, 0.41, 0.45], 20: [0.50, 0.40, 0.46], 0: [0.52, 0.41, 0.45]}
    rows = [{"ratio": "sis", "n": 16, "k": 0, "engine": "float32", "topk": topk, "lr": 1e-4, "seed": seed,
             "key": offpolicy.Cell("sis", n=16, topk=topk, lr=1e-4).key, "test_em": v, "collapsed": False,
             "xi_k": 0.0 if topk == 0 else 0.1 / topk}
            for topk, values in em.items() for seed, v in enumerate(values)]
    entries = offpolicy.summarise(rows)
    ablation = offpolicy.k_ablation(entries)
    assert [e["topk"] for e in ablation] == [1, 5, 20, 0]  # exact (K = V) last
    k1 = ablation[0]
    assert k1["minus_k20"] == pytest.approx(-0.2167, abs=1e-3) and 0 < k1["minus_k20_ci"] < 0.1
    sentence, figures = offpolicy.k_sentence(entries)
    assert sentence.startswith("K ablation (SIS at N = 16, 3 seeds): test EM K=1 0.237 ± ")
    assert "(xi_K 0.1000)" in sentence and "K=V 0.460" in sentence and "(xi_K 0.0000)" not in sentence
    assert "the interval excludes 0 for K=1." in sentence, sentence  # K=5 and exact stay within noise of K=20
    assert figures["K ablation test EM: K=V"] == 0.46
    _, table = offpolicy.table(entries)
    assert [row[4] for row in table] == ["V", 20, 5, 1]
    png = offpolicy.figure(entries, 0.45, tmp_path / "k.png")  # the K panel alone: nothing else varies
    assert png is not None and png.stat().st_size > 1000
    assert offpolicy.k_ablation(entries[:2]) == [] and offpolicy.k_sentence(entries[:2]) == ("", {})
