"""Gateway benchmark: trajectories/s of the asynchronous runner vs a turn-synchronous baseline, and overhead.

Workload (skewed turn counts): a fraction of the trajectories answers at once, the rest search 3-4 times, with
think sections of random length. The turn texts come from a script (`sisrl.services.scripted.ScriptedEngine`,
the workload driver) wrapped around the REAL local engine: every turn runs the real model on the real context
for as many tokens as the scripted turn has, so engine time and batching are real while turn counts are fixed.
The retriever is a real `sisrl-retriever serve` (started here over a small passage subset unless --retriever).

Modes, same engine, retriever, workload and concurrency C:
- async: the gateway's BatchRunner (no turn barrier; a finished trajectory frees its slot; every trajectory
  stored in SQLite as in production).
- turn-sync: groups of C trajectories in lock step, turn by turn (generate all, then search all), the next
  group after the whole group finishes (verl / Search-R1 style; bench/turn_sync.py).
overhead = (wall - time with any engine or retriever call in flight) / wall; agent ms/traj = mean time a
trajectory spends outside engine and retriever calls (parsing, tokenising observations; in turn-sync mode also
waiting at the turn barrier). engine passes = batched model forward passes: where a pass costs about the same
for 1 or C rows (a GPU), throughput follows the pass ratio; on a CPU the cost grows with the rows.

Run: `.venv/bin/python bench/gateway.py` (see --help). Tested on 2 shared CPU cores.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from sisrl.common.cli import add_options, field_options, given
from sisrl.common.models import build_tiny_policy, load_tokenizer
from sisrl.common.procs import Service, free_port, launch_module, wait_healthy
from sisrl.services import store
from sisrl.services.agent import SearchR1Protocol
from sisrl.services.engines.base import Engine, create_engine
from sisrl.services.metrics import GatewayMetrics
from sisrl.services.retrieval_client import RetrievalClient
from sisrl.services.rewards import DEFAULT_SPECS
from sisrl.services.runner import BatchRunner, RunnerDeps
from sisrl.services.schemas import RolloutCreate, RolloutItem, SamplingIn
from sisrl.services.scripted import ScriptedEngine, ScriptRule
from sisrl.services.timing import BusyClock
from turn_sync import run_turn_synchronous  # bench/turn_sync.py: the lock-step baseline

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
FILLER = "the passage says that this answer may depend on which of the two sources is right so check again".split()


@dataclass(frozen=True)
class BenchConfig:
    trajectories: int = field(default=32, metadata={"help": "trajectories per mode"})
    concurrency: int = field(default=8, metadata={"help": "trajectories in flight (C), both modes"})
    quick_fraction: float = field(default=0.5, metadata={"help": "fraction that answers at once (no search)"})
    min_searches: int = field(default=3, metadata={"help": "searches of the other trajectories, at least"})
    max_searches: int = field(default=4, metadata={"help": "searches of the other trajectories, at most"})
    think_min: int = field(default=4, metadata={"help": "filler words per think section, at least"})
    think_max: int = field(default=48, metadata={"help": "filler words per think section, at most"})
    model: str = field(default="tiny", metadata={"help": "'tiny' (random 2-layer Llama) or a policy name/path"})
    retriever: str = field(default="", metadata={"help": "retriever URL; empty: start one over --passages"})
    passages: int = field(default=200, metadata={"help": "corpus passages indexed when starting a retriever"})
    seed: int = field(default=0, metadata={"help": "workload seed"})

    def __post_init__(self) -> None:
        if not 0.0 <= self.quick_fraction <= 1.0:
            raise ValueError(f"quick_fraction: expected a value in [0, 1], got {self.quick_fraction}")
        if not 1 <= self.min_searches <= self.max_searches:
            raise ValueError(f"searches: expected 1 <= min_searches <= max_searches, got "
                             f"{self.min_searches}, {self.max_searches}")
        if self.trajectories < 1 or self.concurrency < 1:
            raise ValueError("trajectories and concurrency: expected positive integers")


def workload(cfg: BenchConfig) -> tuple[list[RolloutItem], list[ScriptRule]]:
    """Items and their scripted turns; the same for both modes."""
    rng = random.Random(cfg.seed)
    questions = [f"synthetic question number {i}" for i in range(cfg.trajectories)]
    if (SHARED / "nq" / "dev.jsonl").is_file():
        with (SHARED / "nq" / "dev.jsonl").open() as handle:
            records = [json.loads(line) for _, line in zip(range(cfg.trajectories), handle, strict=False)]
        questions[: len(records)] = [f"{r['question']} (#{i})" for i, r in enumerate(records)]
    items, rules = [], []
    for i, question in enumerate(questions):
        searches = 0 if rng.random() < cfg.quick_fraction else rng.randint(cfg.min_searches, cfg.max_searches)

        def think() -> str:
            return "<think>" + " ".join(rng.choices(FILLER, k=rng.randint(cfg.think_min, cfg.think_max))) + "</think>\n"

        turns = [think() + f"<search>{question}</search>" for _ in range(searches)]
        turns.append(think() + "<answer>unknown</answer>")
        rules.append(ScriptRule(match=question, turns=tuple(turns)))
        items.append(RolloutItem(id=f"q{i}", question=question, golden_answers=["x"], data_source="nq"))
    return items, rules


def start_retriever(cfg: BenchConfig, tmp: Path) -> tuple[str, Service | None]:
    if cfg.retriever:
        return cfg.retriever, None
    corpus = tmp / "passages.jsonl"
    with (SHARED / "corpus" / "wiki_passages.jsonl").open() as src, corpus.open("w") as dst:
        for _, line in zip(range(cfg.passages), src, strict=False):
            dst.write(line)
    port = free_port()
    service = launch_module("retriever", "sisrl.retriever.cli",
                            ["serve", "--index", str(tmp / "index"), "--corpus", str(corpus), "--encoder", "minilm",
                             "--port", str(port), "--log-level", "warning"], port=port, log=tmp / "retriever.log")
    wait_healthy(service, timeout_s=600)
    return service.url, service


@dataclass
class Result:
    mode: str
    wall_s: float
    busy: dict[str, float]
    trajectories: int
    searches: int
    agent_ms: float  # mean per trajectory of total - engine - retriever time (turn-sync: barrier waits included)
    passes: int  # model forward passes of the local engine (prefill + decode), -1 when unknown


async def run_mode(mode: str, cfg: BenchConfig, engine: Engine, retriever_url: str, rules: list[ScriptRule],
                   request: RolloutCreate, tmp: Path) -> Result:
    tokenizer = load_tokenizer()
    clock = BusyClock()
    retriever = RetrievalClient(retriever_url, topk=3)
    sessions = store.open_db(f"sqlite:///{tmp / f'{mode}.db'}")
    deps = RunnerDeps(engine=ScriptedEngine(tokenizer, rules, base=engine), searcher=retriever,
                      protocol=SearchR1Protocol(tokenizer), sessions=sessions, metrics=GatewayMetrics(clock),
                      clock=clock, reward_specs=dict(DEFAULT_SPECS), max_response_tokens=4096)
    runner = BatchRunner(deps, max_concurrency=cfg.concurrency)
    done: list[tuple[int, dict[str, float]]] = []
    passes0 = _passes(engine)
    start = time.perf_counter()
    if mode == "async":
        with sessions() as session:
            store.create_batch(session=session, batch_id="bench", run="bench", step=0, idempotency_key=None,
                               request_hash="-", request_json=request.model_dump_json(), total=len(request.items))
        runner.start(batch_id="bench", request=request, todo=[(i, 0) for i in range(len(request.items))])
        while runner.is_running("bench"):
            await runner.wait_change("bench", timeout=0.5)
        with sessions() as session:
            rows = store.batch_trajectories(session=session, batch_id="bench")
        done = [(row.num_searches, row.timings) for _, row in rows]
    else:
        await run_turn_synchronous(runner, request, concurrency=cfg.concurrency,
                                   on_done=lambda t: done.append((len(t.turns), t.timings)))
    wall = time.perf_counter() - start
    await retriever.aclose()
    store.dispose(sessions)
    own = [t["total_s"] - t.get("engine_s", 0.0) - t.get("retriever_s", 0.0) for _, t in done]
    passes = _passes(engine) - passes0 if passes0 >= 0 else -1
    return Result(mode, wall, dict(clock.busy_s), len(done), sum(n for n, _ in done), 1000 * sum(own) / len(own),
                  passes)


def _passes(engine: Engine) -> int:
    stats = getattr(engine, "stats", None)
    return int(stats.forward_passes) if stats is not None else -1


def build_engine(cfg: BenchConfig) -> Engine:
    if cfg.model == "tiny":
        tokenizer = load_tokenizer()
        return create_engine("local", model=build_tiny_policy(tokenizer, seed=cfg.seed), tokenizer=tokenizer,
                             max_batch_size=cfg.concurrency)
    return create_engine("local", model=cfg.model, max_batch_size=cfg.concurrency)


async def bench(cfg: BenchConfig) -> list[Result]:
    items, rules = workload(cfg)
    request = RolloutCreate(run="bench", step=0, policy_version=0, items=items, samples_per_item=1,
                            sampling=SamplingIn(max_new_tokens=512, logprobs_k=5, seed=cfg.seed), max_turns=8)
    with tempfile.TemporaryDirectory(prefix="sisrl-bench-") as name:
        tmp = Path(name)
        url, retriever = start_retriever(cfg, tmp)
        engine = build_engine(cfg)
        try:
            await run_mode("warmup", dataclasses.replace(cfg), engine, url, rules,
                           request.model_copy(update={"items": items[: cfg.concurrency]}), tmp)
            results = [await run_mode(mode, cfg, engine, url, rules, request, tmp) for mode in ("turn-sync", "async")]
        finally:
            await engine.close()
            if retriever is not None:
                retriever.stop()
    return results


def table(results: list[Result]) -> str:
    head = "| mode | trajectories | searches | wall s | traj/s | engine busy s | retriever busy s | overhead % | agent ms/traj | engine passes |"
    lines = [head, "|" + "---|" * 10]
    for r in results:
        any_busy = r.busy.get("any", 0.0)
        lines.append(f"| {r.mode} | {r.trajectories} | {r.searches} | {r.wall_s:.2f} | {r.trajectories / r.wall_s:.2f} | "
                     f"{r.busy.get('engine', 0.0):.2f} | {r.busy.get('retriever', 0.0):.2f} | "
                     f"{100 * (r.wall_s - any_busy) / r.wall_s:.1f} | {r.agent_ms:.1f} | {r.passes} |")
    sync, async_ = results
    lines.append(f"\nasync / turn-sync throughput: {sync.wall_s / async_.wall_s:.2f}x (target >= 1.5x); "
                 f"engine passes turn-sync / async: {sync.passes / max(async_.passes, 1):.2f}x; "
                 f"async overhead {100 * (async_.wall_s - async_.busy.get('any', 0.0)) / async_.wall_s:.1f} % "
                 "(target <= 5 %)")
    return "\n".join(lines)


def record_run(cfg: BenchConfig, results: list[Result]) -> None:
    """The async runner's figures against the turn-synchronous baseline of the same run (bench/record.py)."""
    from record import write_record  # bench/record.py: bench/ is on sys.path when a bench runs

    def figures(r: Result) -> dict[str, float]:
        return {"wall s": round(r.wall_s, 2), "traj/s": round(r.trajectories / r.wall_s, 3), "searches": r.searches,
                "overhead %": round(100 * (r.wall_s - r.busy.get("any", 0.0)) / r.wall_s, 2),
                "agent ms/traj": round(r.agent_ms, 1), "engine passes": r.passes}

    sync, async_ = results
    speed_up = sync.wall_s / async_.wall_s
    overhead = figures(async_)["overhead %"]
    write_record(
        bench="gateway", title="Gateway: asynchronous vs turn-synchronous rollouts",
        measures="Trajectories/s of the gateway's asynchronous runner against a turn-synchronous baseline (groups "
                 "of C trajectories in lock step, turn by turn, as verl and Search-R1 run them) on the same real "
                 "engine, retriever, skewed workload and concurrency, and the runner's overhead: the share of wall "
                 "time with no engine or retriever call in flight. Targets: >= 1.5x, overhead <= 5 %.",
        summary=f"The asynchronous runner finished the workload {speed_up:.2f}x faster than the turn-synchronous "
                f"baseline with {overhead:.1f} % overhead.",
        figures={**figures(async_), "async / turn-sync throughput": round(speed_up, 3)},
        baseline={"what": "turn-synchronous groups of C, same engine, retriever and workload",
                  "figures": figures(sync)},
        notes=f"{cfg.trajectories} trajectories, C = {cfg.concurrency}, {cfg.quick_fraction:.0%} answer at once, "
              f"the rest search {cfg.min_searches}-{cfg.max_searches} times; model {cfg.model}; retriever "
              f"{cfg.retriever or f'MiniLM over {cfg.passages} passages, started here'}",
        headline={"row": "Gateway: async vs turn-synchronous rollouts (target >= 1.5x)", "rank": 4,
                  "value": f"**{speed_up:.2f}x** traj/s, overhead {overhead:.1f} %"}
        if dataclasses.replace(cfg, retriever="") == BenchConfig() else None)  # the documented workload only


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    options = field_options(BenchConfig)
    add_options(parser, options)
    cfg = BenchConfig(**given(parser.parse_args(argv), options))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(f"config: {dataclasses.asdict(cfg)}")
    results = asyncio.run(bench(cfg))
    print(table(results))
    record_run(cfg, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
