"""bench/data_plane.py end to end on a small batch: a real store, a real store-only gateway, both paths in fresh
processes; the record holds both paths' figures, the same tensors (the bench refuses to write otherwise), the
trainer's peak against the tensors and the Arrow bytes per column."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # bench/data_plane.py imports its neighbour `record` by that name
from data_plane import fill_store  # noqa: E402


@pytest.mark.timeout(400)
def test_the_bench_runs_both_paths_and_writes_its_record(tmp_path: Path) -> None:
    results, stored = tmp_path / "results", f"sqlite:///{tmp_path / 'stored.db'}"
    tokens = fill_store(stored, n=7, budget=40, k=4, seed=1)  # stands in for a run's rollouts.db (--real-db)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "data_plane.py"), "--trajectories", "24",
                           "--budget", "64", "--k", "4", "--page-size", "5", "--results-dir", str(results),
                           "--real-db", stored, "--topk-logprobs-dtype", "float16", "--note", "test run"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=380)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = sorted((results / "data_plane").glob("*.json"))
    record = json.loads(path.read_text())
    new, old = record["figures"], record["baseline"]["figures"]
    assert new["wire_bytes"] > 0 and old["wire_bytes"] > new["wire_bytes"]  # text is longer than zstd'd Arrow
    assert new["tensors_mb"] == old["tensors_mb"] > 0 and new["peak_over_tensors"] > 0
    per_token = {key.removeprefix("arrow_bytes_per_token_"): v for key, v in new.items()
                 if key.startswith("arrow_bytes_per_token_")}
    assert per_token["topk_logprobs"] > per_token["loss_mask"] and per_token["page"] > 0
    assert [r[0] for r in record["table"]["rows"]][:2] == ["wire_bytes", "broadcast_bytes"]
    assert "24 trajectories" in record["summary"] and "stored as float16" in record["summary"] and record["notes"].endswith("test run")
    assert (new["real_batches"], new["real_tokens"]) == (1, tokens) and new["real_json_over_arrow"] > 1
    assert "On 1 real stored batch (" in record["summary"]
