"""2-process gloo DDP and FSDP2 (fully_shard): one update equals the single-process update on the same batch.

The batch has 7 sequences, so the ranks get 4 and 3 rows (+1 zero-mask pad row): global token counts, the
seq-mean rescaling and micro-batch accumulation must all be right for the sums to agree. The optimizer is SGD
with lr 1, so the parameter change is the gradient itself. Tolerance: atol 2e-6, rtol 1e-4 (float32 sums
taken in a different order across ranks; gradient entries are O(1e-2)).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from sisrl.common.procs import free_port, run_group
from sisrl.trainer.batch import collate
from sisrl.trainer.config import ModelConfig, RolloutConfig
from sisrl.trainer.policy import common_prefix_length, load_policy
from sisrl.trainer.sampling import SyntheticSource

from tests.trainer.ddp_worker import CASES, STRATEGIES, case_config, one_update
from tests.trainer.fsdp_logits_worker import logp_and_grads
from tests.trainer.test_shared_prefix import PREFIX, shared_prefix_trajectories

WORKER = Path(__file__).with_name("ddp_worker.py")


def _batch() -> list:
    torch.manual_seed(0)
    cfg = case_config("is_token_mean", "none")
    model, tok = load_policy(cfg.model, seed=0, device=torch.device("cpu"))
    rollout = RolloutConfig(source="synthetic", prompts_per_step=4, samples_per_prompt=2, synthetic_response_len=5)
    trajs = SyntheticSource(model, rollout, k=8, seed=3, vocab_size=len(tok)).rollouts([], 0, 0)[:7]
    gen = torch.Generator().manual_seed(1)
    out = []
    for i, t in enumerate(trajs):  # move q away from pi so ratios differ from 1, and vary rewards
        noise = (torch.rand(len(t.behaviour_logprobs), generator=gen) - 0.5).tolist()
        # the middle tokens of every other row inserted by the environment (mask 0), as passages are: the
        # compact layout then differs from the full one
        mask = [0 if i % 2 and 0 < j < len(t.loss_mask) - 1 else m for j, m in enumerate(t.loss_mask)]
        out.append(t.__class__(**{**t.to_json(), "behaviour_logprobs": [q + n for q, n in zip(t.behaviour_logprobs, noise, strict=True)],
                                  "reward": float(i % 3), "loss_mask": mask}))
    return out


def test_ddp_and_fsdp2_update_equals_single_process(tmp_path: Path) -> None:
    trajs = _batch()
    batch_path = tmp_path / "batch.json"
    batch_path.write_text(json.dumps([t.to_json() for t in trajs]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(WORKER), str(batch_path), str(tmp_path)]
    proc = run_group(cmd, env=env, timeout_s=240)
    assert proc.returncode == 0, proc.stderr[-3000:]

    init = dict(load_policy(case_config("is_token_mean", "none").model, seed=0,
                            device=torch.device("cpu"))[0].named_parameters())
    for case in CASES:
        single = one_update(case, trajs, "none")
        moved = max(float((value - init[name]).abs().max()) for name, value in single.items())
        assert moved > 1e-3, case  # the update did something
        for strategy in STRATEGIES:
            dist = load_file(str(tmp_path / f"{strategy}_{case}.safetensors"))
            for name, value in single.items():
                torch.testing.assert_close(dist[name], value, atol=2e-6, rtol=1e-4, msg=f"{strategy} {case}: {name}")


def test_fsdp2_checkpoint_of_an_uneven_shard_restores_exactly(tmp_path: Path) -> None:
    """A vocabulary that does not divide by the ranks (Qwen's 151,669 on 2 ranks did not) shards unevenly: the
    restored AdamW state must keep each rank's own rows, and the next step must equal the uninterrupted one."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(WORKER.with_name("fsdp_ckpt_worker.py")), str(tmp_path)]
    proc = run_group(cmd, env=env, timeout_s=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float((tmp_path / "diff.txt").read_text()) == 0.0


def test_fsdp2_compact_logits_equal_the_single_process_ones_and_never_span_the_response(tmp_path: Path) -> None:
    """Under FSDP2 the compact path runs the lm_head on the policy tokens only, as in one process: same log-probs and
    gradients, with and without the shared prefix (a second forward of the root module before the backward).

    No [B, T, V] tensor, by construction: a forward hook on the lm_head records what it was given and returned, and
    every call saw T' (the most policy tokens in a row) positions or the prefix's single one, never T or T + 1.
    The frozen reference is sharded the same way: each rank holds half its bytes as DTensor shards, resharded after
    its forward, and its log-probs are the single-process policy's (same initial weights)."""
    trajs = shared_prefix_trajectories()
    batch = collate(trajs, pad_id=0, k=1)
    assert common_prefix_length(batch) == PREFIX
    batch_path = tmp_path / "batch.json"
    batch_path.write_text(json.dumps([t.to_json() for t in trajs]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(WORKER.with_name("fsdp_logits_worker.py")), str(batch_path), str(tmp_path)]
    proc = run_group(cmd, env=env, timeout_s=240)
    assert proc.returncode == 0, proc.stderr[-3000:]

    report = json.loads((tmp_path / "shapes.json").read_text())
    b, t_prime = batch.size, int(batch.mask.sum(dim=1).max())
    assert t_prime < batch.response_len
    for name in ("full", "shared"):
        torch.manual_seed(0)
        model, _ = load_policy(ModelConfig(path="tiny"), seed=0, device=torch.device("cpu"))
        single = logp_and_grads(model, batch, name == "shared", [])
        dist = load_file(str(tmp_path / f"{name}.safetensors"))
        assert dist.keys() == single.keys()
        for key, value in single.items():
            torch.testing.assert_close(dist[key], value, rtol=1e-4, atol=1e-6, msg=f"{name}: {key}")
        policy_calls = [shapes for shapes in report[f"{name}_head"] if shapes[0][1] != 1]
        assert [shape[:2] for call in policy_calls for shape in call] == [[b, t_prime]] * 2, report
        assert len(report[f"{name}_head"]) == (2 if name == "shared" else 1), report  # the prefix: [1, 1, H]

    ref = report["ref"]
    assert ref["dtensor"] and ref["resharded_after_forward"] and not ref["requires_grad"] and not ref["training"]
    for local in ref["local_bytes"]:
        assert abs(local - ref["total_bytes"] / 2) <= 0.01 * ref["total_bytes"], ref
    torch.testing.assert_close(load_file(str(tmp_path / "ref.safetensors"))["logp"], single["logp"],
                               rtol=1e-5, atol=1e-5)
