"""bench/chaos.py end to end on a tiny world with the tiny policy: the real retriever and gateway as processes,
the demo's teacher and SFT warm start, two RL runs of 2 steps (undisturbed, then with the gateway SIGKILLed once
and restarted on its port and store), the store and step checks, and the record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from sisrl.common.models import build_tiny_policy, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)  # four service starts, the teacher, SFT and two RL runs of 2 steps on CPU
def test_the_bench_kills_the_gateway_once_and_records_a_run_that_lost_and_repeated_nothing(tmp_path: Path) -> None:
    tokenizer = load_tokenizer()
    policy = tmp_path / "policy"
    build_tiny_policy(tokenizer, seed=0).save_pretrained(policy, safe_serialization=True)
    tokenizer.save_pretrained(policy)
    results = tmp_path / "results"
    args = ["--workdir", str(tmp_path / "work"), "--steps", "2", "--kills", "1", "--targets", "gateway",
            "--min-gap-s", "0", "--down-s", "0.5", "--people", "12", "--towns", "4", "--policy", str(policy),
            "--encoder", "minilm", "--results-dir", str(results),
            "--set", "rollout.prompts_per_step=2", "--set", "rollout.samples_per_prompt=2",
            "--set", "rollout.max_new_tokens=12", "--set", "rollout.max_turns=2", "--set", "sft.max_trajectories=8",
            "--set", "model.trainable_layers=null", "--set", "optim.lr=1e-3"]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "chaos.py"), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = sorted((results / "chaos").glob("*.json"))
    record = json.loads(path.read_text())
    figures, base = record["figures"], record["baseline"]["figures"]
    assert figures["checks passed"] is True and figures["kills done"] == 1 and figures["kills: gateway"] == 1
    assert figures["kills: retriever"] == 0
    for run in (figures, base):  # each trajectory once: 2 batches of 2 x 2, steps 1 and 2 trained once
        assert (run["trajectories stored"], run["distinct trajectory ids"], run["batches"]) == (8, 8, 2)
        assert run["steps trained"] == [1, 2] and 0.0 <= run["test EM"] <= 1.0
    assert base["gateway request retries"] == 0 and base["batch resumes"] == 0  # nothing to ride out undisturbed
    # the trainer met the dead gateway: it retried a request, resumed the batch or pushed its policy again
    assert figures["gateway request retries"] + figures["batch resumes"] + figures["policy re-pushes"] >= 1
    ((_, service, at_s, _, restart_s),) = record["table"]["rows"]
    assert service == "gateway" and at_s > 0 and restart_s > 0
    assert figures["EM difference (chaos - undisturbed)"] == round(figures["test EM"] - base["test EM"], 4)
