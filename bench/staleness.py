"""Staleness study: GRPO with plain IS vs SIS, TIS and IcePop ratios at N mini-batch updates per rollout batch.

    python bench/staleness.py [--steps 12] [--ns 1 4 8 16] [--ratios is sis tis icepop] [--seeds 0]

Task: the synthetic token task of trainer/sampling.py (tiny 2-layer Llama over the SmolLM2 vocabulary; reward =
share of the 6 sampled tokens whose id is divisible by 4; random policy ~0.25). Base config:
trainer/configs/staleness.yaml. Per (ratio, N): final reward (mean of the last two steps), mean accept rate,
D and D_SIS (per sequence, mean over steps), clip fraction, wall time, and the final reward minus plain GRPO's
at the same N (the baseline of the same run). For ratios other than sis, the sis/* columns are diagnostics of
the same accept test (what SIS would have accepted); the loss does not use them.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from record import write_record
from sisrl.trainer.config import load_config
from sisrl.trainer.loop import train

CONFIG = Path(__file__).resolve().parents[1] / "trainer" / "configs" / "staleness.yaml"


def run_one(ratio: str, n: int, steps: int, seed: int, root: Path) -> dict[str, float]:
    cfg = load_config(CONFIG, [f"run_dir={root / f'{ratio}_{n}_{seed}'}", f"algorithm.ratio={ratio}",
                               f"algorithm.staleness={n}", f"total_steps={steps}", f"seed={seed}"])
    t0 = time.perf_counter()
    hist = train(cfg)
    wall = time.perf_counter() - t0

    def mean(key: str) -> float:
        vals = [h[key] for h in hist if key in h]
        return sum(vals) / len(vals) if vals else float("nan")

    return {"final_reward": sum(h["reward/mean"] for h in hist[-2:]) / 2, "accept": mean("sis/accept_rate"),
            "D": mean("sis/D"), "D_sis": mean("sis/D_sis"), "clip": mean("loss/clipfrac"), "wall_s": wall,
            "skipped": sum(h["guard/skipped_updates"] for h in hist)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="rollout batches per run (default 12)")
    parser.add_argument("--ns", type=int, nargs="+", default=[1, 4, 8, 16], help="staleness values N")
    parser.add_argument("--ratios", nargs="+", default=["is", "sis", "tis", "icepop"], help="ratio strategies")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds (results are averaged)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows: dict[tuple[str, int], dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.ns:
            for ratio in args.ratios:
                runs = [run_one(ratio, n, args.steps, s, Path(tmp)) for s in args.seeds]
                rows[(ratio, n)] = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
                r = rows[(ratio, n)]
                print(f"  done grpo+{ratio} N={n}: reward {r['final_reward']:.3f} ({r['wall_s']:.0f}s)", flush=True)
    header = (f"{'loss+ratio':14s} {'N':>3s} {'final R':>8s} {'vs IS':>7s} {'accept':>7s} {'D':>7s} {'D_SIS':>7s} "
              f"{'clip':>6s} {'skip':>5s} {'wall s':>7s}")
    print(header)
    print("-" * len(header))
    table: list[list[object]] = []
    for (ratio, n), r in rows.items():
        base = rows.get(("is", n), {}).get("final_reward", float("nan"))
        print(f"{'grpo+' + ratio:14s} {n:>3d} {r['final_reward']:>8.3f} {r['final_reward'] - base:>+7.3f} "
              f"{r['accept']:>7.3f} {r['D']:>7.3f} {r['D_sis']:>7.3f} {r['clip']:>6.3f} {r['skipped']:>5.0f} "
              f"{r['wall_s']:>7.1f}")
        table.append([f"grpo+{ratio}", n, round(r["final_reward"], 3), round(r["final_reward"] - base, 3),
                      *(round(r[k], 3) for k in ("accept", "D", "D_sis", "clip")), int(r["skipped"]),
                      round(r["wall_s"], 1)])
    record_study(args, rows, table)


def record_study(args: argparse.Namespace, rows: dict[tuple[str, int], dict[str, float]],
                 table: list[list[object]]) -> None:
    """SIS's final reward per N against plain GRPO's (IS) at the same N, the baseline of the same run; every
    ratio in the table."""
    def finals(ratio: str) -> dict[str, float]:
        return {f"final reward, N = {n}": round(rows[ratio, n]["final_reward"], 3) for n in args.ns
                if (ratio, n) in rows}

    shown = "sis" if "sis" in args.ratios else args.ratios[0]
    top = max(args.ns)
    has_pair = ("sis", top) in rows and ("is", top) in rows
    headline = has_pair and top == 16 and args.steps == 12  # the README row is the documented study's
    write_record(
        bench="staleness", title="Staleness study on a toy task",
        measures="GRPO with the plain IS ratio against SIS, TIS and IcePop at N mini-batch updates per rollout batch "
                 "on the synthetic token task (tiny 2-layer Llama over the SmolLM2 vocabulary; reward = share of "
                 "sampled tokens whose id is divisible by 4, random ~0.25): final reward (mean of the last two "
                 "batches), accept rate, D and D_SIS, clip fraction, wall time.",
        summary=(f"At N = {top} SIS ended at reward {rows['sis', top]['final_reward']:.3f} against plain IS's "
                 f"{rows['is', top]['final_reward']:.3f}" if has_pair else
                 f"Final rewards of {', '.join(args.ratios)} at N = {', '.join(map(str, args.ns))}")
        + f" ({len(args.seeds)} seed(s), {args.steps} steps).",
        figures={"ratio": shown, **finals(shown)},
        baseline={"what": "plain GRPO (IS ratio) at the same N, same run", "figures": {"ratio": "is", **finals("is")}}
        if "is" in args.ratios and shown != "is" else None,
        table={"columns": ["loss+ratio", "N", "final R", "vs IS", "accept", "D", "D_SIS", "clip", "skip", "wall s"],
               "rows": table},
        notes=f"seeds {args.seeds} (averaged); {args.steps} rollout batches per run; config "
              "trainer/configs/staleness.yaml; torch threads 1",
        headline={"row": f"Staleness (toy task): final reward at N = {top}", "rank": 8,
                  "value": f"SIS **{rows['sis', top]['final_reward']:.3f}**, plain IS "
                           f"{rows['is', top]['final_reward']:.3f}"} if headline else None)


if __name__ == "__main__":
    main()
