"""One training step's data plane: a stored batch -> REST -> the padded tensors the update reads, JSON vs Arrow.

A synthetic batch of N trajectories (prompt ~200 tokens; responses of 25-100 % of a `--budget` token budget, the
demo's spread scaled up, with three inserted passages of 12 % each; K = `--k` behaviour top-K per token) is
written into a real SQLite rollout store with the store's own table, and served by a real
`sisrl-gateway serve --store-only` process on loopback. Each path then runs in a fresh child process (so its
peak RSS is its own), against a fresh gateway (whose peak RSS, VmHWM, is reported too):

- JSON (the path before issue 44, the baseline): `GET /v1/batches/{id}` -> `Trajectory.from_json` -> the JSON
  broadcast bytes ranks exchanged (encoded and decoded once) -> `batch.collate`.
- Arrow (the trainer's path now): `GET /v1/batches/{id}/trajectories.arrow` pages, checked -> `Trajectory` ->
  the Arrow IPC broadcast bytes (encoded and decoded once) -> `arrow_batch.collate_arrow`.

Both must give the same tensors (their SHA-256 is compared). Figures: bytes on the wire (response bodies), seconds
per stage and in all, peak RSS of the trainer process and of the gateway.

    .venv/bin/python bench/data_plane.py                        # 256 trajectories, 2k budget, K = 20
    .venv/bin/python bench/data_plane.py --trajectories 2560   # the recipe's step (512 prompts x 5 samples)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from record import write_record
from sisrl.common.procs import free_port, launch_module, wait_healthy
from sisrl.services import store

BATCH = "bench-batch"
PASSAGE_SHARE = 0.12  # each of three inserted passages, as a share of the response


def fill_store(db_url: str, *, n: int, budget: int, k: int, seed: int) -> int:
    """N trajectories of one done batch, written as the store writes them (packed little-endian blobs);
    returns the number of response tokens."""
    rng = np.random.default_rng(seed)
    sessions = store.open_db(db_url)
    tokens = 0
    with sessions() as s:
        store.create_batch(session=s, batch_id=BATCH, run="bench", step=0, idempotency_key=None, request_hash="-",
                           request_json=json.dumps(_request(n)), total=n)
        store.set_batch_status(session=s, batch_id=BATCH, status="done")
        for i in range(n):
            t = int(budget * rng.uniform(0.25, 1.0))
            mask = np.ones(t, np.uint8)
            for start in rng.integers(0, max(t - int(t * PASSAGE_SHARE), 1), 3):
                mask[start:start + int(t * PASSAGE_SHARE)] = 0
            logq = np.where(mask > 0, -rng.exponential(0.7, t), 0.0).astype(np.float32)
            top = np.where(mask[:, None] > 0, np.sort(-rng.exponential(3.0, (t, k)), axis=1)[:, ::-1], 0.0)
            s.add(store.TrajectoryRow(
                id=f"t{i}", batch_id=BATCH, item_id=f"q{i // 5}", sample_index=i % 5, group_id=f"g{i // 5}",
                run="bench", step=0, data_source="nq", question="q?", golden_answers=["a"],
                prompt_ids=store.pack(rng.integers(0, 49_000, int(rng.integers(150, 250))), np.int32),
                response_ids=store.pack(rng.integers(0, 49_000, t), np.int32), loss_mask=store.pack(mask, np.uint8),
                behaviour_logprobs=store.pack(logq, np.float32), topk_k=k,
                topk_ids=store.pack(rng.integers(0, 49_000, (t, k)), np.int32),
                topk_logprobs=store.pack(top.astype(np.float32), np.float32), turns=[], num_searches=0,
                response_len=t, finish_reason="answer", answer="a", reward=float(rng.random() < 0.4), em=0.0,
                f1=0.0, format=0.0, policy_version=0, token_versions=store.pack(np.where(mask > 0, 0, -1), np.int32),
                policy_version_max=0, timings={}, error=None))
            tokens += t
            if i % 64 == 63:
                s.commit()
        s.commit()
    store.dispose(sessions)
    return tokens


def _request(n: int) -> dict[str, Any]:
    items = [{"id": f"q{i}", "question": "q?", "golden_answers": ["a"], "data_source": "nq"} for i in range(n // 5)]
    return {"run": "bench", "step": 0, "policy_version": 0, "items": items, "samples_per_item": 5}


def worker(path: str, url: str, k: int, page_size: int) -> dict[str, Any]:
    """One path in this (child) process: seconds per stage, bytes on the wire, peak RSS, the tensors' hash."""
    import httpx
    from sisrl.trainer.arrow_batch import (
        collate_arrow,
        decode_page,
        fetch_trajectories,
        page_trajectories,
        trajectories_from_ipc,
        trajectories_to_batch,
        trajectories_to_ipc,
    )
    from sisrl.trainer.batch import Trajectory, collate

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    wire = 0

    def count(resp: httpx.Response) -> None:
        nonlocal wire
        resp.read()
        wire += resp.num_bytes_downloaded

    with httpx.Client(base_url=url, timeout=600, event_hooks={"response": [count]}) as http:
        # Warm-up, not timed: pyarrow's first array costs ~0.5 s once per process (gateway and trainer alike),
        # which a training step after the first never pays again.
        if path == "json":
            Trajectory.from_json(http.get("/v1/rollouts/t0").json())
        else:
            resp = http.get(f"/v1/batches/{BATCH}/trajectories.arrow", params={"limit": 1})
            one = page_trajectories(decode_page(resp.content, resp.headers, batch_id=BATCH, offset=0))
            collate_arrow(trajectories_to_batch(trajectories_from_ipc(trajectories_to_ipc(one))), pad_id=0, k=k)
        wire = 0
        t0 = time.perf_counter()
        if path == "json":
            trajs = [Trajectory.from_json(t) for t in http.get(f"/v1/batches/{BATCH}").json()["trajectories"]]
        else:
            trajs = fetch_trajectories(http, BATCH, page_size=page_size)
        t1 = time.perf_counter()
    if path == "json":  # the broadcast bytes before issue 44 (trainer/batch.py's trajectories_to_bytes)
        raw = json.dumps([t.to_json() for t in trajs]).encode()
        trajs = [Trajectory.from_json(o) for o in json.loads(raw.decode())]
    else:
        raw = trajectories_to_ipc(trajs)
        trajs = trajectories_from_ipc(raw)
    t2 = time.perf_counter()
    b = collate(trajs, pad_id=0, k=k) if path == "json" else collate_arrow(trajectories_to_batch(trajs), pad_id=0, k=k)
    t3 = time.perf_counter()
    digest = hashlib.sha256()
    for name in ("input_ids", "attention_mask", "response_ids", "mask", "logq", "topk_ids", "topk_logq", "rewards"):
        digest.update(getattr(b, name).numpy().tobytes())
    return {"fetch_s": t1 - t0, "broadcast_s": t2 - t1, "collate_s": t3 - t2, "total_s": t3 - t0,
            "wire_bytes": wire, "broadcast_bytes": len(raw), "peak_rss_mb": resource.getrusage(
                resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_after_imports_mb": rss0 / 1024,
            "tensors_sha256": digest.hexdigest()}


def run_path(path: str, db_url: str, k: int, page_size: int, workdir: Path) -> dict[str, Any]:
    """A fresh gateway and a fresh child process for one path; the gateway's peak RSS read before it stops."""
    port = free_port()
    gateway = launch_module("gateway", "sisrl.services.cli", ["serve", "--store-only", "--db-url", db_url, "--port",
                            str(port), "--log-level", "warning"], port=port, log=workdir / f"gateway-{path}.log",
                            env={"SISRL_GATEWAY_API_TOKEN": None})
    try:
        wait_healthy(gateway, timeout_s=120)
        done = subprocess.run([sys.executable, __file__, "--worker", path, "--url", gateway.url, "--k", str(k),
                               "--page-size", str(page_size)], capture_output=True, text=True, check=True)
        out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        status = Path(f"/proc/{gateway.process.pid}/status")
        hwm = [line for line in status.read_text().splitlines() if line.startswith("VmHWM")] if status.exists() else []
        out["gateway_peak_rss_mb"] = int(hwm[0].split()[1]) / 1024 if hwm else None
        return out
    finally:
        gateway.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trajectories", type=int, default=256, help="trajectories in the batch (the recipe: 2560)")
    p.add_argument("--budget", type=int, default=2048, help="response token budget; lengths are 25-100 %% of it")
    p.add_argument("--k", type=int, default=20, help="behaviour top-K per token")
    p.add_argument("--page-size", type=int, default=64, help="trajectories per Arrow page")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", choices=("json", "arrow"), help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.url, args.k, args.page_size)))  # noqa: T201
        return
    with tempfile.TemporaryDirectory(prefix="data_plane-") as tmp:
        db_url = f"sqlite:///{Path(tmp) / 'rollouts.db'}"
        tokens = fill_store(db_url, n=args.trajectories, budget=args.budget, k=args.k, seed=args.seed)
        res = {path: run_path(path, db_url, args.k, args.page_size, Path(tmp)) for path in ("json", "arrow")}
    if res["json"]["tensors_sha256"] != res["arrow"]["tensors_sha256"]:
        raise SystemExit("bench/data_plane.py: the JSON and Arrow paths gave different tensors; no record written")
    report(args, tokens, res)


def report(args: argparse.Namespace, tokens: int, res: dict[str, dict[str, Any]]) -> None:
    keys = ("wire_bytes", "broadcast_bytes", "fetch_s", "broadcast_s", "collate_s", "total_s", "peak_rss_mb",
            "gateway_peak_rss_mb")
    rows = [[key, round(res["json"][key], 3), round(res["arrow"][key], 3),
             round(res["json"][key] / max(res["arrow"][key], 1e-9), 2)] for key in keys]
    print(f"{args.trajectories} trajectories, {tokens} response tokens, K = {args.k}")  # noqa: T201
    print("| figure | JSON | Arrow | JSON / Arrow |\n|---|---|---|---|")  # noqa: T201
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")  # noqa: T201
    ratio = res["json"]["total_s"] / res["arrow"]["total_s"]
    write_record(
        bench="data_plane", title="Data plane: a stored batch to the update's tensors, JSON vs Arrow",
        measures="One step's batch from a real SQLite rollout store through a real store-only gateway over "
                 "loopback HTTP to the padded tensors: fetch and parse, the broadcast bytes encoded and decoded "
                 "once, collate; each path in a fresh process against a fresh gateway. Bytes are response bodies.",
        summary=f"{args.trajectories} trajectories ({tokens} response tokens, K = {args.k}): Arrow pages reach the "
                f"same tensors {ratio:.1f}x faster than JSON, with "
                f"{res['json']['wire_bytes'] / res['arrow']['wire_bytes']:.1f}x fewer bytes on the wire and "
                f"{res['json']['gateway_peak_rss_mb'] / res['arrow']['gateway_peak_rss_mb']:.1f}x less gateway "
                f"memory; the trainer's peak ({res['arrow']['peak_rss_mb']:.0f} MB against "
                f"{res['json']['peak_rss_mb']:.0f} MB) is the batch held as Trajectory lists on both paths.",
        figures={key: res["arrow"][key] for key in keys},
        baseline={"what": "the JSON path (GET /v1/batches/{id}, JSON broadcast, batch.collate), same run",
                  "figures": {key: res["json"][key] for key in keys}},
        table={"columns": ["figure", "JSON", "Arrow", "JSON / Arrow"], "rows": rows},
        notes=f"{args.trajectories} trajectories, responses 25-100 % of {args.budget} tokens, 36 % inserted, "
              f"K = {args.k}, Arrow pages of {args.page_size}; a 2-core machine shared with other jobs, so seconds "
              "are indicative; tensors of both paths hash the same.")


if __name__ == "__main__":
    main()
