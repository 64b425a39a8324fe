"""`sisrl-train`: train, evaluate, plot, and list the config knobs.

  sisrl-train train --config FILE [--set KEY=VALUE ...]      (torchrun ... -m sisrl.trainer.cli train ... too)
  sisrl-train sft --config FILE [--set KEY=VALUE ...]        warm start on trajectories stored at the gateway
  sisrl-train eval --checkpoint DIR --data FILE [--data FILE ...] [--gateway-url URL]
  sisrl-train plot RUN_DIR
  sisrl-train config [--config FILE]                         every knob: key, default (or value), description
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from sisrl.common.cli import DefaultsHelp
from sisrl.trainer import node
from sisrl.trainer.config import (
    TOKEN_ENV,
    AlgorithmConfig,
    ConfigError,
    RolloutConfig,
    describe_fields,
    load_config,
    lookup,
)

if TYPE_CHECKING:
    from sisrl.trainer.evaluate import EvalSettings


def build_parser() -> argparse.ArgumentParser:
    fmt = DefaultsHelp
    parser = argparse.ArgumentParser(prog="sisrl-train", description="SIS trainer for LLM search agents.")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train (resumes from RUN_DIR's newest checkpoint)", formatter_class=fmt)
    t.add_argument("--config", type=Path, default=None, help="YAML config (see `sisrl-train config`); none = defaults")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one knob, e.g. --set algorithm.staleness=8 (repeatable; YAML values)")
    t.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"], help="logging level")
    s = sub.add_parser("sft", help="supervised warm start on stored trajectories (writes RUN_DIR/hf)",
                       formatter_class=fmt)
    s.add_argument("--config", type=Path, default=None, help="YAML config with an `sft` section; none = defaults")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one knob, e.g. --set sft.runs=[teacher] (repeatable; YAML values)")
    s.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"], help="logging level")
    e = sub.add_parser("eval", help="EM per data source of a checkpoint, through the gateway", formatter_class=fmt)
    e.add_argument("--checkpoint", type=Path, required=True,
                   help="a trainer checkpoint (RUN_DIR/checkpoints/step_N) or an HF directory, under the gateway's checkpoint root")
    e.add_argument("--data", action="append", required=True, help="question file (.jsonl or .parquet); repeatable")
    e.add_argument("--gateway-url", default=RolloutConfig().gateway_url, help="gateway base URL")
    e.add_argument("--api-token", default=None, help="gateway bearer token (visible in the process list: prefer "
                   "$SISRL_GATEWAY_API_TOKEN, read when this is unset)")
    e.add_argument("--limit", type=int, default=None, help="at most this many questions per file")
    e.add_argument("--version", type=int, default=None, help="policy version to announce (default: the checkpoint's step)")
    e.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (unset: 0, greedy, as the trainer's own evaluation)")
    e.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"tokens per turn (unset: the run's rollout.max_new_tokens, else {RolloutConfig().max_new_tokens})")
    e.add_argument("--max-turns", type=int, default=None,
                   help="generations per trajectory; each search and the answer is one (unset: the run's "
                        f"rollout.max_turns, else {RolloutConfig().max_turns})")
    e.add_argument("--top-p", type=float, default=None,
                   help=f"nucleus mass (unset: the run's rollout.top_p, else {RolloutConfig().top_p})")
    e.add_argument("--logprobs-k", type=int, default=None,
                   help="K of the behaviour top-K the gateway records, not passages per search (unset: the run's "
                        f"algorithm.logprobs_k, else {AlgorithmConfig().logprobs_k})")
    e.add_argument("--seed", type=int, default=None, help="sampling seed (unset: the run's seed, else 0)")
    p = sub.add_parser("plot", help="PNG curves of RUN_DIR/metrics.jsonl into RUN_DIR/plots", formatter_class=fmt)
    p.add_argument("run_dir", type=Path, help="a run directory holding metrics.jsonl")
    p.add_argument("--out", type=Path, default=None, help="output folder (default RUN_DIR/plots)")
    n = sub.add_parser("node", help="start a config's retriever, vLLM servers, gateway and trainer on one node "
                       "(docs/guides/gpu.md)", formatter_class=fmt)
    node.add_arguments(n)
    c = sub.add_parser("config", help="list every config knob with its default and description", formatter_class=fmt)
    c.add_argument("--config", type=Path, default=None, help="show this file's values instead of the defaults")
    c.add_argument("--markdown", action="store_true", help="print the table as docs/trainer.md has it")
    return parser


def _train(args: argparse.Namespace) -> int:
    from sisrl.trainer.loop import train
    from sisrl.trainer.procs import sigterm_as_interrupt

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config, args.overrides)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight load/save bars would break the per-step table
    try:
        with sigterm_as_interrupt():
            history = train(cfg)
    except KeyboardInterrupt:
        print(f"interrupted; checkpoints in {Path(cfg.run_dir) / 'checkpoints'} are complete. Run the same command "
              "to resume.", file=sys.stderr)
        return 130
    print(f"done: {len(history)} steps this run; metrics in {Path(cfg.run_dir) / 'metrics.jsonl'}")
    return 0


def _sft(args: argparse.Namespace) -> int:
    from sisrl.trainer.procs import sigterm_as_interrupt
    from sisrl.trainer.sft import train_sft
    from transformers.utils import logging as hf_logging

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config, args.overrides)
    hf_logging.disable_progress_bar()
    try:
        with sigterm_as_interrupt():
            result = train_sft(cfg)
    except KeyboardInterrupt:
        print("interrupted: no policy was written (the warm start is short; run the same command again)",
              file=sys.stderr)
        return 130
    print(f"done: {result.steps} steps on {result.demonstrations} demonstrations; policy in {result.path}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    import json
    import secrets

    from sisrl.trainer.data import load_items
    from sisrl.trainer.evaluate import evaluate, export_hf, gateway_note
    from sisrl.trainer.gateway_client import GatewayClient

    settings = eval_settings(args)
    hf_dir = export_hf(args.checkpoint)
    version = args.version
    if version is None:
        state = args.checkpoint / "trainer_state.json"
        version = json.loads(state.read_text())["policy_version"] if state.is_file() else 0
    items = [it for path in args.data for it in load_items(path, limit=args.limit)]
    if args.api_token is not None:
        print(f"sisrl-train eval: --api-token is visible in the process list; set {TOKEN_ENV} instead",
              file=sys.stderr)
    client = GatewayClient(args.gateway_url, token=args.api_token or os.environ.get(TOKEN_ENV) or None)
    note = gateway_note(settings.run_dir, client.health().get("rollout"))
    print(f"{settings.describe()}; {note}", file=sys.stderr)
    client.push_policy(hf_dir.resolve(), version)
    v = settings.values
    run = f"eval-{hf_dir.parent.name}"
    # A key of its own: an earlier eval's (run, step) key on this gateway's store, of another checkpoint with the
    # same step or of other settings, would get its stored batch back, or a 409. Within this call a gateway
    # restart still resumes the batch (same body, same key).
    result = evaluate(client, items, run=run, step=version, version=version, cfg=settings.rollout(args.gateway_url),
                      k=int(v["logprobs_k"]), seed=int(v["seed"]), temperature=float(v["temperature"]),
                      key=f"{run}-eval:{version}:{secrets.token_hex(8)}")
    for key, value in result.items():
        print(f"{key:32s} {value:8.4f}")
    return 0


def eval_settings(args: argparse.Namespace) -> EvalSettings:
    """The per-request settings of `eval`: each flag given wins, then the run that wrote the checkpoint, then the
    defaults (`evaluate.eval_settings`). The run's own limits matter: a policy trained to search twice, evaluated
    with fewer generations, never gets to answer."""
    from sisrl.trainer.evaluate import FOLLOWED
    from sisrl.trainer.evaluate import eval_settings as resolve

    return resolve(args.checkpoint, {name: getattr(args, name) for name in (*FOLLOWED, "temperature")})


def _plot(args: argparse.Namespace) -> int:
    from sisrl.trainer.plot import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


def _config(args: argparse.Namespace) -> int:
    rows = describe_fields()
    if args.config is not None:
        dumped = load_config(args.config).model_dump()
        rows = [(key, repr(lookup(dumped, key)), desc) for key, _, desc in rows]
    if args.markdown:
        print("| key | default | description |\n|---|---|---|")
        for key, value, desc in rows:
            print(f"| `{key}` | `{value}` | {desc.replace('|', chr(92) + '|')} |")
        return 0
    width = max(len(k) for k, _, _ in rows)
    for key, value, desc in rows:
        print(f"{key:{width}s}  {value:24s}  {desc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"train": _train, "sft": _sft, "eval": _eval, "plot": _plot, "config": _config, "node": node.main}
    try:
        return handlers[args.command](args)
    except ConfigError as err:
        print(f"sisrl-train: {err}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as err:
        print(f"sisrl-train {args.command}: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        from sisrl.trainer.gateway_client import GatewayError  # imported here: it pulls in torch

        if not isinstance(err, GatewayError):
            raise
        print(f"sisrl-train {args.command}: {err}", file=sys.stderr)  # gateway down or refusing: one line
        return 1


if __name__ == "__main__":
    sys.exit(main())
