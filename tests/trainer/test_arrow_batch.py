"""The Arrow form rank 0 broadcasts (`trajectories_to_ipc` / `trajectories_from_ipc`): trajectories come back
equal field for field and collate to the same tensors; bytes cut or altered are refused, never decoded."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from sisrl.common import arrow_wire
from sisrl.common.procs import free_port, run_group
from sisrl.trainer.arrow_batch import (
    collate_arrow,
    collate_trajectories,
    trajectories_from_ipc,
    trajectories_to_batch,
    trajectories_to_ipc,
)
from sisrl.trainer.batch import Trajectory, collate


def _traj(i: int, **over: object) -> Trajectory:
    """3 response tokens, the middle one inserted; K = 2; log-probs exact in float32 (multiples of 1/8)."""
    base: dict[str, object] = dict(
        id=f"t{i}", item_id=f"q{i}", group_id=f"g{i // 2}", data_source="nq", prompt_ids=[1, 2, 3 + i],
        response_ids=[7, 8 + i, 9], loss_mask=[1, 0, 1], behaviour_logprobs=[-0.125 * (i + 1), 0.0, -2.5],
        topk_ids=[[7, 3], [0, 0], [9, 4]], topk_logprobs=[[-0.125 * (i + 1), -3.0], [0.0, 0.0], [-2.5, -2.75]],
        reward=0.5 * i, reward_parts={"em": float(i % 2), "f1": 0.25}, turns=[{"query": "x", "doc_ids": ["1"],
                                                                                "scores": [0.5]}],
        finish_reason="answer", answer=None if i else "a", policy_version=4, token_versions=[4, -1, 5],
        error="boom" if i == 2 else None)
    base.update(over)
    return Trajectory(**base)  # type: ignore[arg-type]


def test_a_broadcast_round_trip_keeps_every_field_and_tensor() -> None:
    trajs = [_traj(0), _traj(1, token_versions=None), _traj(2), _traj(3, response_ids=[], loss_mask=[],
                                                                      behaviour_logprobs=[], topk_ids=[],
                                                                      topk_logprobs=[], token_versions=[])]
    back = trajectories_from_ipc(trajectories_to_ipc(trajs))
    assert back == trajs and back != [_traj(0)] + trajs[1:3] + [_traj(3)]
    a, b = collate(back, pad_id=0, k=2), collate(trajs, pad_id=0, k=2)
    for name in ("input_ids", "mask", "logq", "topk_ids", "topk_logq", "rewards"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_an_empty_row_at_an_inserted_token_travels_as_zeros_a_short_policy_row_is_refused() -> None:
    ragged = _traj(0, topk_ids=[[7, 3], [], [9, 4]], topk_logprobs=[[-0.125, -3.0], [], [-2.5, -2.75]])
    back = trajectories_from_ipc(trajectories_to_ipc([ragged]))[0]
    assert back.topk_ids.tolist() == [[7, 3], [0, 0], [9, 4]] and back.topk_logprobs[1].tolist() == [0.0, 0.0]
    assert torch.equal(collate([back], pad_id=0, k=2).topk_logq, collate([ragged], pad_id=0, k=2).topk_logq)
    short = _traj(0, topk_ids=[[7, 3], [0, 0], [9]], topk_logprobs=[[-0.125, -3.0], [0.0, 0.0], [-2.5]])
    with pytest.raises(ValueError, match="trajectory t0: token 2 has a top-K row of 1 ids"):
        trajectories_to_ipc([short])


def test_cut_or_relabelled_broadcast_bytes_are_refused() -> None:
    raw = trajectories_to_ipc([_traj(0), _traj(1)])
    with pytest.raises(arrow_wire.PageError, match="broadcast batch page offset=0: not a complete Arrow IPC"):
        trajectories_from_ipc(raw[: len(raw) - 64])
    batch = pa.ipc.open_stream(raw).read_next_batch()
    lying = batch.schema.with_metadata({**batch.schema.metadata, arrow_wire.META_ROWS: b"3"})
    with pytest.raises(arrow_wire.PageError, match="header says 3 trajectories, the record batch holds 2"):
        trajectories_from_ipc(arrow_wire.to_stream(pa.RecordBatch.from_arrays(batch.columns, schema=lying)))
    retyped = pa.RecordBatch.from_arrays(
        [c.cast(pa.list_(pa.float64())) if n == "behaviour_logprobs" else c
         for n, c in zip(batch.schema.names, batch.columns, strict=True)], names=batch.schema.names)
    with pytest.raises(arrow_wire.PageError, match="schema differs"):
        trajectories_from_ipc(arrow_wire.to_stream(retyped))


FIELDS = ("input_ids", "attention_mask", "position_ids", "response_ids", "mask", "logq", "topk_ids", "topk_logq",
          "rewards")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_vectorised_collate_equals_the_loop_bit_for_bit(seed: int) -> None:
    """Random lengths (an empty response included), masks, K_row = 5 truncated to k = 3, pad id 7."""
    rng = np.random.default_rng(seed)
    trajs = []
    for i in range(7):
        n_r = 0 if i == 3 else int(rng.integers(1, 30))
        mask = (rng.random(n_r) < 0.6).astype(int).tolist()
        trajs.append(_traj(i, prompt_ids=rng.integers(0, 1000, int(rng.integers(1, 12))).tolist(),
                           response_ids=rng.integers(0, 1000, n_r).tolist(), loss_mask=mask,
                           behaviour_logprobs=(-rng.exponential(1.0, n_r)).astype(np.float32).tolist(),
                           topk_ids=rng.integers(0, 1000, (n_r, 5)).tolist(),
                           topk_logprobs=(-rng.exponential(2.0, (n_r, 5))).astype(np.float32).tolist(),
                           token_versions=[4] * n_r, reward=float(rng.normal())))
    b = collate(trajs, pad_id=7, k=3)
    views = trajectories_from_ipc(trajectories_to_ipc(trajs))  # the trainer's form: numpy views of the page
    for a in (collate_arrow(trajectories_to_batch(trajs), pad_id=7, k=3),
              *(collate_trajectories(views, pad_id=7, k=3, chunk=c) for c in (1, 3, 64))):
        for name in FIELDS:
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and torch.equal(x, y), name
        assert a.group_ids == b.group_ids


def test_decoded_trajectories_are_read_only_views_of_the_page_not_python_lists() -> None:
    """What keeps the trainer's memory at the pages plus the tensors: a decoded trajectory's per-token fields
    are numpy views sharing one values buffer per column (no per-token Python object), and none is writable."""
    back = trajectories_from_ipc(trajectories_to_ipc([_traj(0), _traj(1)]))
    for name in ("prompt_ids", "response_ids", "loss_mask", "behaviour_logprobs", "topk_ids", "topk_logprobs",
                 "token_versions"):
        first, second = getattr(back[0], name), getattr(back[1], name)
        assert isinstance(first, np.ndarray) and not first.flags.writeable, name
        assert np.shares_memory(first.base if first.base is not None else first,
                                second.base if second.base is not None else second), name
    assert back[0].topk_ids.shape == (3, 2) and back[0].policy_tokens == 2
    with pytest.raises(ValueError, match="read-only"):
        back[0].behaviour_logprobs[0] = 0.0


def test_the_vectorised_collate_refuses_a_policy_token_short_of_k() -> None:
    with pytest.raises(ValueError, match=r"trajectory t0: policy token 0 has a top-K row of 2 entries, fewer than K=3"):
        collate_arrow(trajectories_to_batch([_traj(0)]), pad_id=0, k=3)


def test_every_rank_gets_rank_0s_batch_through_the_loop(tmp_path: Path) -> None:
    """`loop._rollouts` under torchrun, 2 gloo ranks: the Arrow IPC broadcast gives each rank rank 0's batch."""
    trajs = [_traj(0), _traj(1, token_versions=None), _traj(2), _traj(3, topk_ids=[[7, 3], [], [9, 4]],
                                                                      topk_logprobs=[[-0.5, -3.0], [], [-2.5, -2.75]])]
    (tmp_path / "batch.json").write_text(json.dumps([t.to_json() for t in trajs]))
    worker = Path(__file__).with_name("broadcast_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(worker), str(tmp_path / "batch.json"), str(tmp_path)]
    proc = run_group(cmd, env=env, timeout_s=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = trajs[:3] + [_traj(3, topk_ids=[[7, 3], [0, 0], [9, 4]], topk_logprobs=[[-0.5, -3.0], [0.0, 0.0],
                                                                                        [-2.5, -2.75]])]
    for rank in (0, 1):
        got = [Trajectory.from_json(t) for t in json.loads((tmp_path / f"rank{rank}.json").read_text())]
        assert got == expected, rank
