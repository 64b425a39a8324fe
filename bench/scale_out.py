"""Scale-out benchmark: the same trajectories through G gateways x E engine servers on one PostgreSQL store.

Every process is real and on this machine: E policy servers (`sisrl.services.engines.openai_server`, the tiny
random policy, `--threads` each), G gateways (`sisrl-gateway serve --engine scripted --script-base vllm-http`,
each over all E servers as one pool, all on one PostgreSQL database), one retriever (MiniLM over a passage
subset) and a private PostgreSQL cluster (tests/utils/pg_cluster.py). The workload is bench/gateway.py's: scripted
turn counts (half answer at once, the rest search 3-4 times) around real engine calls on the real contexts.
The trajectories are split evenly over the gateways, one batch each, submitted together; wall time runs from the
first submit to the last batch done. Responses are capped at 1792 tokens and observations at 256 so every
context fits the tiny policy's 2048 positions (a longer one is a 400 from its server, a trajectory error).

Scaling model (checked against the measured points): per trajectory, each component c costs cpu_c CPU seconds
(read from /proc for its processes). With P cores, N engine servers of T threads, G gateways (each one Python
thread), one retriever and one store:
    traj/s <= P / sum_c cpu_c                    (the cores)
    traj/s <= N*T / cpu_engine                   (the engine servers)
    traj/s <= G / cpu_gateway, 1 / cpu_retriever (one core each at most)
and the first bound reached saturates. The table prints each bound for every topology.

Run: `.venv/bin/python bench/scale_out.py` (see --help); `--topologies 1x1,2x2` are gateways x engine servers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from sisrl.common.cli import add_options, field_options, given
from sisrl.common.models import build_tiny_policy, load_tokenizer
from sisrl.common.procs import Service, free_port, launch_module, wait_healthy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gateway as single  # noqa: E402  (bench/gateway.py: the workload and the retriever start-up)
from bench_module import pg_cluster  # noqa: E402

_pg = pg_cluster()  # tests/utils/pg_cluster.py
Cluster, Unavailable, start_cluster = _pg.Cluster, _pg.Unavailable, _pg.start_cluster


@dataclass(frozen=True)
class ScaleConfig:
    trajectories: int = field(default=512, metadata={"help": "trajectories per topology"})
    topologies: str = field(default="1x1,2x2", metadata={"help": "comma-separated GATEWAYSxSERVERS"})
    concurrency: int = field(default=32, metadata={"help": "trajectories in flight per gateway"})
    server_threads: int = field(default=1, metadata={"help": "torch threads per engine server"})
    server_batch: int = field(default=32, metadata={"help": "--max-batch-size of each engine server"})
    passages: int = field(default=200, metadata={"help": "corpus passages indexed by the retriever"})
    seed: int = field(default=0, metadata={"help": "workload and policy seed"})

    def shapes(self) -> list[tuple[int, int]]:
        out = []
        for part in self.topologies.split(","):
            try:
                g, e = (int(x) for x in part.strip().lower().split("x"))
            except ValueError:
                raise ValueError(f"topologies: expected GATEWAYSxSERVERS such as 2x2, got {part!r}") from None
            if g < 1 or e < 1:
                raise ValueError(f"topologies: expected positive counts, got {part!r}")
            out.append((g, e))
        return out


@dataclass
class Point:
    gateways: int
    servers: int
    trajectories: int
    wall_s: float
    p50_s: float
    p99_s: float
    errors: int
    cpu_s: dict[str, float]  # CPU seconds per component over the measured batch


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and their children so far (gone ones count 0)."""
    total = 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                times = p.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


def postmaster_pid(cluster: Cluster) -> int:
    return int((cluster.data / "postmaster.pid").read_text().split("\n", 1)[0])


def batch_body(run: str, items: list[Any], seed: int) -> dict[str, Any]:
    return {"run": run, "step": 0, "policy_version": 0, "items": [item.model_dump() for item in items],
            "samples_per_item": 1, "max_turns": 8,
            "sampling": {"max_new_tokens": 512, "temperature": 1.0, "top_p": 1.0, "logprobs_k": 5, "seed": seed}}


def run_batches(gateways: list[Service], parts: list[list[Any]], run: str, seed: int) -> tuple[float, list[dict]]:
    """Submit one batch per gateway at once; wait for all; (wall seconds, every trajectory)."""
    clients = [httpx.Client(base_url=g.url, timeout=120) for g in gateways]
    start = time.perf_counter()
    ids = [c.post("/v1/rollouts", json=batch_body(run, part, seed)).raise_for_status().json()["batch_id"]
           for c, part in zip(clients, parts, strict=True)]
    done: dict[int, dict[str, Any]] = {}
    while len(done) < len(ids):
        for i, (client, batch_id) in enumerate(zip(clients, ids, strict=True)):
            if i not in done:
                status = client.get(f"/v1/batches/{batch_id}").json()
                if status["status"] != "running":
                    done[i] = status
        time.sleep(0.05)
    wall = time.perf_counter() - start
    trajectories = []
    for client, batch_id in zip(clients, ids, strict=True):
        trajectories += client.get(f"/v1/batches/{batch_id}").raise_for_status().json()["trajectories"]
        client.close()
    return wall, trajectories


def measure(cfg: ScaleConfig, gateways_n: int, servers_n: int, *, tmp: Path, policy: Path, script: Path,
            items: list[Any], retriever: Service, cluster: Cluster) -> Point:
    servers, gateways = [], []
    try:
        for i in range(servers_n):
            port = free_port()
            servers.append(launch_module(
                f"engine server {i}", "sisrl.services.engines.openai_server",
                ["--model", str(policy), "--port", str(port), "--threads", str(cfg.server_threads),
                 "--max-batch-size", str(cfg.server_batch), "--log-level", "warning"],
                port=port, log=tmp / f"server{gateways_n}x{servers_n}_{i}.log", env={"SISRL_ENGINE_API_TOKEN": None}))
        wait_healthy(*servers, timeout_s=600)
        db = cluster.create_database()
        urls = ",".join(s.url for s in servers)
        for i in range(gateways_n):
            port = free_port()
            gateways.append(launch_module(
                f"gateway {i}", "sisrl.services.cli",
                ["serve", "--port", str(port), "--db-url", db, "--engine", "scripted", "--script", str(script),
                 "--script-base", "vllm-http", "--engine-url", urls, "--model", str(policy),
                 "--retriever-url", retriever.url, "--max-concurrency", str(cfg.concurrency),
                 "--max-response-tokens", "1792", "--observation-max-tokens", "256", "--checkpoint-root", str(tmp),
                 "--engine-retries", "1"],
                port=port, log=tmp / f"gateway{gateways_n}x{servers_n}_{i}.log",
                env={"SISRL_GATEWAY_LOG_LEVEL": "warning", "SISRL_GATEWAY_API_TOKEN": None}))
        wait_healthy(*gateways, timeout_s=600)
        warm = [items[i :: gateways_n][: cfg.concurrency // 4 or 1] for i in range(gateways_n)]
        run_batches(gateways, warm, f"warm{gateways_n}x{servers_n}", cfg.seed)
        groups = {"engine": [s.process.pid for s in servers], "gateway": [g.process.pid for g in gateways],
                  "retriever": [retriever.process.pid], "store": [postmaster_pid(cluster)]}
        before = {name: cpu_seconds(pids) for name, pids in groups.items()}
        parts = [items[i::gateways_n] for i in range(gateways_n)]
        wall, trajectories = run_batches(gateways, parts, f"scale{gateways_n}x{servers_n}", cfg.seed)
        used = {name: cpu_seconds(pids) - before[name] for name, pids in groups.items()}
    finally:
        for service in gateways + servers:
            service.stop()
    failed = sorted({str(t["error"])[:300] for t in trajectories if t["finish_reason"] == "error"})
    for reason in failed[:3]:
        print(f"  error in {gateways_n}x{servers_n}: {reason}")
    totals = sorted(t["timings"]["total_s"] for t in trajectories)
    return Point(gateways_n, servers_n, len(trajectories), wall, statistics.median(totals),
                 totals[min(len(totals) - 1, int(0.99 * len(totals)))],
                 sum(t["finish_reason"] == "error" for t in trajectories), used)


def bounds(point: Point, cores: int, threads: int) -> dict[str, float]:
    """The model's traj/s ceilings for this topology from its own per-trajectory CPU costs."""
    n = point.trajectories
    per = {name: seconds / n for name, seconds in point.cpu_s.items()}
    return {
        "cores": cores / sum(per.values()),
        "engine": point.servers * threads / per["engine"] if per["engine"] else float("inf"),
        "gateway": point.gateways / per["gateway"] if per["gateway"] else float("inf"),
        "retriever": 1 / per["retriever"] if per["retriever"] else float("inf"),
    }


def table(points: list[Point], cfg: ScaleConfig) -> str:
    cores = os.cpu_count() or 1
    head = ("| gateways x servers | trajectories | errors | wall s | traj/s | ratio | p50 s | p99 s | CPU s/traj: "
            "engine, gateway, retriever, store | bound traj/s: cores, engine, gateway, retriever |")
    lines = [head, "|" + "---|" * 10]
    base = points[0].trajectories / points[0].wall_s
    for p in points:
        rate = p.trajectories / p.wall_s
        per = ", ".join(f"{p.cpu_s[c] / p.trajectories * 1000:.1f} ms" for c in ("engine", "gateway", "retriever",
                                                                                  "store"))
        b = bounds(p, cores, cfg.server_threads)
        lims = ", ".join(f"{b[c]:.1f}" for c in ("cores", "engine", "gateway", "retriever"))
        lines.append(f"| {p.gateways}x{p.servers} | {p.trajectories} | {p.errors} | {p.wall_s:.1f} | {rate:.2f} | "
                     f"{rate / base:.2f}x | {p.p50_s:.2f} | {p.p99_s:.2f} | {per} | {lims} |")
    lines.append(f"\n{cores} CPU cores; ratio = traj/s over the first row's (same run, same workload).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    options = field_options(ScaleConfig)
    add_options(parser, options)
    cfg = ScaleConfig(**given(parser.parse_args(argv), options))
    shapes = cfg.shapes()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(f"config: {dataclasses.asdict(cfg)}")
    try:
        cluster = start_cluster()
    except Unavailable as exc:
        print(f"no PostgreSQL server here: {exc}")
        return 1
    with tempfile.TemporaryDirectory(prefix="sisrl-scale-") as name:
        tmp = Path(name)
        tokenizer = load_tokenizer()
        policy = tmp / "policy"
        build_tiny_policy(tokenizer, seed=cfg.seed).save_pretrained(policy, safe_serialization=True)
        tokenizer.save_pretrained(policy)
        work = single.BenchConfig(trajectories=cfg.trajectories, concurrency=cfg.concurrency, passages=cfg.passages,
                                  seed=cfg.seed)
        items, rules = single.workload(work)
        script = tmp / "script.json"
        script.write_text(json.dumps({"rules": [{"match": r.match, "turns": list(r.turns)} for r in rules]}))
        _, retriever = single.start_retriever(work, tmp)
        assert retriever is not None
        points = []
        try:
            for g, e in shapes:
                print(f"measuring {g} gateway(s) x {e} engine server(s) ...", flush=True)
                points.append(measure(cfg, g, e, tmp=tmp, policy=policy, script=script, items=items,
                                      retriever=retriever, cluster=cluster))
        finally:
            retriever.stop()
            cluster.stop()
    print(table(points, cfg))
    record_run(cfg, points)
    return 0


def record_run(cfg: ScaleConfig, points: list[Point]) -> None:
    """The last topology against the first (the baseline, same run and workload) (bench/record.py)."""
    from record import write_record  # bench/record.py: bench/ is on sys.path when a bench runs

    def figures(p: Point) -> dict[str, float]:
        per = {f"CPU ms/traj: {c}": round(p.cpu_s[c] / p.trajectories * 1000, 1) for c in sorted(p.cpu_s)}
        return {"traj/s": round(p.trajectories / p.wall_s, 3), "p50 s": round(p.p50_s, 2), "p99 s": round(p.p99_s, 2),
                "errors": p.errors, **per}

    first, last = points[0], points[-1]
    speed_up = (last.trajectories / last.wall_s) / (first.trajectories / first.wall_s)
    cores = os.cpu_count() or 1
    write_record(
        bench="scale_out", title="Scale-out: gateways x engine servers on one PostgreSQL",
        measures="Trajectories/s of the same workload (bench/gateway.py's) through G gateways x E engine servers on "
                 "one PostgreSQL store, every process real on this machine, with each component's CPU seconds per "
                 "trajectory and the bound on traj/s they give (cores, engine, gateway, retriever).",
        summary=f"{last.gateways} gateways x {last.servers} engine servers ran {speed_up:.2f}x the trajectories/s "
                f"of {first.gateways} x {first.servers} on {cores} cores.",
        figures={"topology": f"{last.gateways}x{last.servers}", **figures(last),
                 **{f"bound traj/s: {k}": round(v, 2) for k, v in bounds(last, cores, cfg.server_threads).items()}},
        baseline={"what": f"{first.gateways} gateway(s) x {first.servers} server(s), same run and workload",
                  "figures": {"topology": f"{first.gateways}x{first.servers}", **figures(first)}},
        table={"columns": ["gateways x servers", "trajectories", "errors", "wall s", "traj/s", "p50 s", "p99 s"],
               "rows": [[f"{p.gateways}x{p.servers}", p.trajectories, p.errors, round(p.wall_s, 1),
                         round(p.trajectories / p.wall_s, 3), round(p.p50_s, 2), round(p.p99_s, 2)] for p in points]},
        notes=f"{cfg.trajectories} trajectories per topology, {cfg.concurrency} in flight per gateway, "
              f"{cfg.server_threads} torch thread(s) per engine server; tiny random policy",
        headline={"row": "Scale-out: traj/s, gateways x engine servers on one PostgreSQL", "rank": 6,
                  "value": f"**{speed_up:.2f}x** ({last.gateways}x{last.servers} vs {first.gateways}x{first.servers})"}
        if cfg == ScaleConfig() else None)  # the documented topologies and workload only


if __name__ == "__main__":
    sys.exit(main())
