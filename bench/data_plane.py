"""One training step's data plane: a stored batch -> REST -> the padded tensors the update reads, JSON vs Arrow.

A synthetic batch of N trajectories (prompt ~200 tokens; responses of 25-100 % of a `--budget` token budget, the
demo's spread scaled up, with three inserted passages of 12 % each; K = `--k` behaviour top-K per policy token, id
0 and log-prob 0 at inserted tokens as the gateway records them; top-K ids uniform over the vocabulary and
log-probs random float32, the worst case for compression) is written into a real SQLite rollout store with the
store's own table, and served by a real `sisrl-gateway serve --store-only` process on loopback. Each path then runs
in a fresh child process (so its peak RSS is its own), against a fresh gateway (whose peak RSS, VmHWM, is reported
too):

- JSON (the path before issue 44, the baseline): `GET /v1/batches/{id}` -> `Trajectory.from_json` -> the JSON
  broadcast bytes ranks exchanged (encoded and decoded once) -> `batch.collate`.
- Arrow (the trainer's path now): `GET /v1/batches/{id}/trajectories.arrow` pages, checked -> `Trajectory` views
  of the pages -> the Arrow IPC broadcast bytes (encoded and decoded once) -> `arrow_batch.collate_trajectories`.

Both must give the same tensors (their SHA-256 is compared). Figures: bytes on the wire (response bodies), seconds
per stage and in all, peak RSS of the trainer process and of the gateway, and the trainer's peak above its RSS
after imports against the collated tensors' own bytes (the issue's "<= 2x the tensors"). The Arrow bytes of each
column (zstd-compressed, per response token) show where the wire bytes go.

    .venv/bin/python bench/data_plane.py                        # 256 trajectories, 2k budget, K = 20
    .venv/bin/python bench/data_plane.py --trajectories 2560   # the recipe's step (512 prompts x 5 samples)
    .venv/bin/python bench/data_plane.py --topk-logprobs-dtype float16  # a gateway that stores them as halves
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


def fill_store(db_url: str, *, n: int, budget: int, k: int, seed: int, topk_dtype: str = "float32") -> int:
    """N trajectories of one done batch, written as the store writes them (packed little-endian blobs; top-K
    log-probs rounded to half floats as a gateway with `topk_logprobs_dtype: float16` stores them, when
    `topk_dtype` says so); returns the number of response tokens."""
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
            top = top.astype(np.float32)
            if topk_dtype == "float16":
                top = top.astype(np.float16).astype(np.float32)
            top_ids = np.where(mask[:, None] > 0, rng.integers(0, 49_000, (t, k)), 0)  # agent.py: 0 when inserted
            s.add(store.TrajectoryRow(
                id=f"t{i}", batch_id=BATCH, item_id=f"q{i // 5}", sample_index=i % 5, group_id=f"g{i // 5}",
                run="bench", step=0, data_source="nq", question="q?", golden_answers=["a"],
                prompt_ids=store.pack(rng.integers(0, 49_000, int(rng.integers(150, 250))), np.int32),
                response_ids=store.pack(rng.integers(0, 49_000, t), np.int32), loss_mask=store.pack(mask, np.uint8),
                behaviour_logprobs=store.pack(logq, np.float32), topk_k=k,
                topk_ids=store.pack(top_ids, np.int32), topk_logprobs=store.pack(top, np.float32),
                turns=[], num_searches=0,
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
        collate_trajectories,
        decode_page,
        fetch_trajectories,
        page_trajectories,
        release_unused_memory,
        trajectories_from_ipc,
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
            collate_trajectories(trajectories_from_ipc(trajectories_to_ipc(one)), pad_id=0, k=k)
            del one, resp
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
    else:  # as loop._rollouts: rank 0 encodes what it keeps, every rank decodes; the bytes go before collate
        raw = trajectories_to_ipc(trajs)
        trajs = trajectories_from_ipc(raw)
    broadcast_bytes = len(raw)
    del raw
    if path == "arrow":
        release_unused_memory()
    t2 = time.perf_counter()
    b = collate(trajs, pad_id=0, k=k) if path == "json" else collate_trajectories(trajs, pad_id=0, k=k)
    t3 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    digest, tensor_bytes = hashlib.sha256(), 0
    for name in ("input_ids", "attention_mask", "position_ids", "response_ids", "mask", "logq", "topk_ids",
                 "topk_logq", "rewards"):
        tensor = getattr(b, name)
        tensor_bytes += tensor.numel() * tensor.element_size()
        if name != "position_ids":
            digest.update(tensor.numpy().tobytes())
    extra_mb = peak - rss0 / 1024
    return {"fetch_s": t1 - t0, "broadcast_s": t2 - t1, "collate_s": t3 - t2, "total_s": t3 - t0,
            "wire_bytes": wire, "broadcast_bytes": broadcast_bytes, "peak_rss_mb": peak,
            "rss_after_imports_mb": rss0 / 1024, "peak_above_imports_mb": extra_mb,
            "tensors_mb": tensor_bytes / 2**20, "peak_over_tensors": extra_mb / (tensor_bytes / 2**20),
            "tensors_sha256": digest.hexdigest()}


def column_bytes(url: str, k: int, page_size: int) -> dict[str, float]:
    """zstd-compressed Arrow bytes of each column of the batch's first page, per response token of that page."""
    import httpx
    import pyarrow as pa
    from sisrl.common import arrow_wire
    from sisrl.trainer.arrow_batch import decode_page

    resp = httpx.get(f"{url}/v1/batches/{BATCH}/trajectories.arrow", params={"limit": page_size}, timeout=600)
    page = decode_page(resp.content, resp.headers, batch_id=BATCH, offset=0)
    tokens = int(page.column("response_ids").value_lengths().to_numpy().sum())
    out = {}
    for name in page.schema.names:
        one = pa.RecordBatch.from_arrays([page.column(name)], names=[name])
        out[name] = round(len(arrow_wire.to_stream(one)) / tokens, 2)
    out["page"] = round(len(resp.content) / tokens, 2)
    return out


def real_bytes(db_url: str, k: int, page_size: int, workdir: Path) -> dict[str, float]:
    """Bytes on the wire of real stored batches (every done batch whose trajectories carry top-K >= k), both forms,
    through a store-only gateway on `db_url`: what the synthetic batch's mix of policy and inserted tokens
    assumes, measured on trajectories an engine wrote."""
    import sqlite3

    import httpx

    path = db_url.removeprefix("sqlite:///")
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as con:
        ids = [row[0] for row in con.execute("SELECT DISTINCT batch_id FROM trajectories WHERE topk_k >= ?", (k,))]
    port = free_port()
    gateway = launch_module("gateway", "sisrl.services.cli", ["serve", "--store-only", "--db-url", db_url, "--port",
                            str(port), "--log-level", "warning"], port=port, log=workdir / "gateway-real.log",
                            env={"SISRL_GATEWAY_API_TOKEN": None})
    out = {"real_batches": 0.0, "real_tokens": 0.0, "real_policy_tokens": 0.0, "real_json_bytes": 0.0,
           "real_arrow_bytes": 0.0}
    try:
        wait_healthy(gateway, timeout_s=120)
        with httpx.Client(base_url=gateway.url, timeout=600) as http:
            for batch_id in ids:
                whole = http.get(f"/v1/batches/{batch_id}")
                if whole.status_code != 200 or whole.json().get("status") != "done":
                    continue
                trajs = whole.json()["trajectories"]
                out["real_batches"] += 1
                out["real_json_bytes"] += len(whole.content)
                out["real_tokens"] += sum(len(t["response_ids"]) for t in trajs)
                out["real_policy_tokens"] += sum(sum(t["loss_mask"]) for t in trajs)
                offset: str | None = "0"
                while offset is not None:
                    page = http.get(f"/v1/batches/{batch_id}/trajectories.arrow",
                                    params={"offset": offset, "limit": page_size})
                    page.raise_for_status()
                    out["real_arrow_bytes"] += len(page.content)
                    offset = page.headers.get("X-Sisrl-Next-Offset")
    finally:
        gateway.stop()
    if not out["real_batches"]:
        raise SystemExit(f"bench/data_plane.py: no done batch with top-K >= {k} in {db_url}")
    out["real_json_over_arrow"] = out["real_json_bytes"] / out["real_arrow_bytes"]
    return out


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
        if path == "arrow":
            out["column_bytes_per_token"] = column_bytes(gateway.url, k, page_size)
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
    p.add_argument("--topk-logprobs-dtype", choices=("float32", "float16"), default="float32",
                   help="precision the store keeps top-K log-probs in (the gateway's topk_logprobs_dtype)")
    p.add_argument("--paths", nargs="+", choices=("json", "arrow"), default=["json", "arrow"],
                   help="paths to run (the JSON path of a 2,560-trajectory step needs ~25 GB between gateway and "
                        "trainer; --paths arrow measures the new path alone)")
    p.add_argument("--real-db", help="also measure the bytes of the real batches stored in this rollout store "
                                      "(sqlite:///PATH, e.g. a bench's or a run's rollouts.db), both forms")
    p.add_argument("--results-dir", type=Path, default=None, help="record folder (default: bench/results)")
    p.add_argument("--note", default="", help="a sentence for the record's notes (say if the CPU was shared)")
    p.add_argument("--worker", choices=("json", "arrow"), help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.url, args.k, args.page_size)))  # noqa: T201
        return
    with tempfile.TemporaryDirectory(prefix="data_plane-") as tmp:
        db_url = f"sqlite:///{Path(tmp) / 'rollouts.db'}"
        tokens = fill_store(db_url, n=args.trajectories, budget=args.budget, k=args.k, seed=args.seed,
                            topk_dtype=args.topk_logprobs_dtype)
        if "arrow" not in args.paths:
            raise SystemExit("bench/data_plane.py: --paths must include arrow (the path the record is about)")
        res = {path: run_path(path, db_url, args.k, args.page_size, Path(tmp)) for path in args.paths}
        if args.real_db:
            res["arrow"].update(real_bytes(args.real_db, args.k, args.page_size, Path(tmp)))
    if "json" in res and res["json"]["tensors_sha256"] != res["arrow"]["tensors_sha256"]:
        raise SystemExit("bench/data_plane.py: the JSON and Arrow paths gave different tensors; no record written")
    report(args, tokens, res)


def report(args: argparse.Namespace, tokens: int, res: dict[str, dict[str, Any]]) -> None:
    keys = ("wire_bytes", "broadcast_bytes", "fetch_s", "broadcast_s", "collate_s", "total_s", "peak_rss_mb",
            "gateway_peak_rss_mb", "peak_above_imports_mb", "tensors_mb", "peak_over_tensors")
    arrow, json_ = res["arrow"], res.get("json")
    memory = (f"the trainer's peak rose {arrow['peak_above_imports_mb']:.0f} MB above its RSS after imports, "
              f"{arrow['peak_over_tensors']:.2f}x the collated tensors' {arrow['tensors_mb']:.0f} MB")
    if json_ is not None:
        rows = [[key, round(json_[key], 3), round(arrow[key], 3), round(json_[key] / max(arrow[key], 1e-9), 2)]
                for key in keys]
        columns = ["figure", "JSON", "Arrow", "JSON / Arrow"]
        summary = (f"Arrow pages reach the same tensors {json_['total_s'] / arrow['total_s']:.1f}x faster than "
                   f"JSON, with {json_['wire_bytes'] / arrow['wire_bytes']:.1f}x fewer bytes on the wire and "
                   f"{json_['gateway_peak_rss_mb'] / arrow['gateway_peak_rss_mb']:.1f}x less gateway memory; "
                   f"{memory} (JSON: {json_['peak_over_tensors']:.2f}x).")
        baseline = {"what": "the JSON path (GET /v1/batches/{id}, JSON broadcast, batch.collate), same run",
                    "figures": {key: json_[key] for key in keys}}
    else:
        rows = [[key, round(arrow[key], 3)] for key in keys]
        columns = ["figure", "Arrow"]
        summary = f"the Arrow path only (--paths arrow): {memory}, in {arrow['total_s']:.1f} s."
        baseline = {"what": "the collated tensors' own size, same run (the target: peak above imports <= 2x it)",
                    "figures": {"tensors_mb": arrow["tensors_mb"]}}
    real = ""
    if "real_json_over_arrow" in arrow:
        n = int(arrow["real_batches"])
        real = (f" On {n} real stored batch{'es' if n != 1 else ''} ({arrow['real_tokens']:.0f} response tokens, "
                f"{arrow['real_policy_tokens'] / arrow['real_tokens']:.0%} sampled by the policy) the Arrow pages "
                f"are {arrow['real_json_over_arrow']:.1f}x fewer bytes than JSON.")
    print(f"{args.trajectories} trajectories, {tokens} response tokens, K = {args.k}{real}")  # noqa: T201
    print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")  # noqa: T201
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")  # noqa: T201
    write_record(
        bench="data_plane", title="Data plane: a stored batch to the update's tensors, JSON vs Arrow",
        measures="One step's batch from a real SQLite rollout store through a real store-only gateway over "
                 "loopback HTTP to the padded tensors: fetch and parse, the broadcast bytes encoded and decoded "
                 "once, collate; each path in a fresh process against a fresh gateway. Bytes are response bodies; "
                 "peak_over_tensors = (peak RSS - RSS after imports) / the tensors' bytes.",
        summary=f"{args.trajectories} trajectories ({tokens} response tokens, K = {args.k}, top-K log-probs "
                f"stored as {args.topk_logprobs_dtype}): {summary}" + real,
        figures={**{key: arrow[key] for key in keys}, **{key: v for key, v in arrow.items() if key.startswith("real_")},
                 **{f"arrow_bytes_per_token_{name}": v for name, v in arrow["column_bytes_per_token"].items()}},
        baseline=baseline,
        table={"columns": columns, "rows": rows},
        notes=f"{args.trajectories} trajectories, responses 25-100 % of {args.budget} tokens, 36 % inserted, "
              f"K = {args.k} (top-K log-probs stored as {args.topk_logprobs_dtype}), Arrow pages of "
              f"{args.page_size}; tensors of both paths hash the same. "
              + args.note, results_dir=args.results_dir)


if __name__ == "__main__":
    main()
