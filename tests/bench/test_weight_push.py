"""bench/weight_push.py end to end on a tiny Qwen2-shaped model: both paths, one process and 2-rank FSDP2, each cell
in fresh processes; the record's figures, baseline, table (measured and arithmetic rows) and summary."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from sisrl.common.procs import run_group

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # bench/weight_push.py imports its neighbour `record` by that name
from weight_push import param_counts  # noqa: E402


@pytest.mark.timeout(600)  # six fresh processes, two of them torchrun pairs
def test_the_bench_pushes_both_ways_and_writes_its_record(tmp_path: Path) -> None:
    results = tmp_path / "results"
    proc = run_group([sys.executable, str(ROOT / "bench" / "weight_push.py"), "--sizes", "tiny", "--shard-mb", "1",
                      "--results-dir", str(results), "--workdir", str(tmp_path), "--notes", "test run"],
                     cwd=tmp_path, timeout_s=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = sorted((results / "weight_push").glob("*.json"))
    assert len(records) == 1, proc.stdout
    record = json.loads(records[0].read_text())
    new, old = record["figures"], record["baseline"]["figures"]
    assert set(new) == set(old) == {f"tiny_{mode}_{k}" for mode in ("single", "fsdp2")
                                    for k in ("push_s", "push_cpu_s", "rank0_peak_mb", "weight_mb")} | {"tiny_fsdp2_rank1_peak_mb"}
    params, embedding = param_counts("tiny")
    # bf16 is half of fp32, up to the safetensors headers; under FSDP2 the old path also wrote the tied head
    for mode, ratio in (("single", 2.0), ("fsdp2", 2.0 * (params + embedding) / params)):
        # MB are rounded to 0.1 in the record: a tiny model's ratio is only that exact
        assert abs(old[f"tiny_{mode}_weight_mb"] - ratio * new[f"tiny_{mode}_weight_mb"]) <= 0.05 + 0.05 * ratio, mode
        assert new[f"tiny_{mode}_push_s"] > 0 and old[f"tiny_{mode}_push_s"] > 0
    rows = record["table"]["rows"]
    assert [r[2] for r in rows] == ["old, one process", "new, one process", "old, 2-rank FSDP2", "new, 2-rank FSDP2",
                                    "old, FSDP2 (arithmetic)", "new, FSDP2 (arithmetic)"]
    old_arith, new_arith = rows[-2], rows[-1]
    assert old_arith[7] == round((params + embedding) * 4 / 2**20, 1)  # MB per push: fp32, the tied head twice
    assert new_arith[7] == round(params * 2 / 2**20, 1)
    assert record["summary"].startswith("In one process (tiny-shaped) the bf16 shards are 2.0x fewer bytes, rank 0's")
    assert record["notes"].endswith("test run") and record["command"].startswith("bench/weight_push.py --sizes tiny")
