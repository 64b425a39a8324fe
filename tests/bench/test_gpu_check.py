"""bench/gpu_check.py, the GPU check's update measurement, through its CPU path (tiny shape, seconds): it builds
the Qwen2-architecture model, runs the trainer's log-prob path and AdamW, and writes its record; and it refuses
`--device cuda` where there is no CUDA device, with one line. bench/gpu_check.sh itself needs a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def test_the_update_check_runs_on_a_cpu_and_writes_its_record(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--shapes", "tiny", "--batch", "2",
                           "--prompt", "16", "--response", "32", "--steps", "1", "--results-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = (tmp_path / "gpu_check").glob("*.json")
    data = json.loads(record.read_text())
    cols, (row,) = data["table"]["columns"], data["table"]["rows"]
    assert row[0] == "tiny" and row[cols.index("tokens/s")] > 0 and row[cols.index("peak GiB")] is None


def test_cuda_is_refused_without_a_gpu(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        return
    proc = subprocess.run([sys.executable, str(SCRIPT), "--results-dir", str(tmp_path)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "--device cuda: no CUDA device here" in proc.stderr
