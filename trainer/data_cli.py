"""`sisrl-data`: prepare question files for training.

  sisrl-data prepare --out DIR [--from-dir FLASHRAG_DIR] [--datasets nq hotpotqa] [--limit N]
  sisrl-data demo --out DIR [--seed S]

`prepare` reads FlashRAG's NQ and HotpotQA JSONL files (`{id, question, golden_answers, metadata}`) from
`--from-dir` when given, else downloads them from the Hugging Face hub dataset `RUC-NLPIR/FlashRAG_datasets`
(FlashRAG's published location) and writes `{id, question, golden_answers, data_source}` rows. Offline, it says
so and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import httpx
from sisrl.common.cli import DefaultsHelp
from sisrl.trainer.data import load_items, write_items
from sisrl.trainer.demo_data import write_demo_data

HUB_REPO = "RUC-NLPIR/FlashRAG_datasets"
SPLITS = {"nq": ("train", "test"), "hotpotqa": ("train", "dev")}


def _hub_reachable() -> str | None:
    """None when the hub answers; otherwise why not (checked once, quickly, before any download)."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False"):
        return "HF_HUB_OFFLINE is set"
    try:
        httpx.head("https://huggingface.co", timeout=5.0)
    except httpx.HTTPError as err:
        return f"huggingface.co is unreachable ({type(err).__name__})"
    return None


def _download(dataset: str, split: str) -> Path:
    """Fetch `{dataset}/{split}.jsonl` from the hub; RuntimeError with a clear message when unreachable."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as err:  # pragma: no cover - transformers depends on it
        raise RuntimeError("huggingface_hub is not installed; pass --from-dir with local FlashRAG files") from err
    try:
        return Path(hf_hub_download(HUB_REPO, f"{dataset}/{split}.jsonl", repo_type="dataset"))
    except Exception as err:
        raise RuntimeError(
            f"cannot download {dataset}/{split}.jsonl from the Hugging Face hub ({HUB_REPO}): {type(err).__name__}. "
            "The hub is unreachable or HF_HUB_OFFLINE=1 is set. Copy FlashRAG's files to a folder laid out as "
            "DIR/nq/train.jsonl, DIR/hotpotqa/dev.jsonl, ... and pass --from-dir DIR."
        ) from None


def convert(src: Path, dst: Path, data_source: str, limit: int | None) -> int:
    items = load_items(src, data_source=data_source, limit=limit)
    items = [it.__class__(id=it.id, question=it.question, golden_answers=it.golden_answers, data_source=data_source)
             for it in items]
    write_items(dst, items)
    return len(items)


def prepare(out: Path, datasets: list[str], from_dir: Path | None, limit: int | None) -> list[tuple[Path, int]]:
    written = []
    if from_dir is None and (why := _hub_reachable()) is not None:
        raise RuntimeError(
            f"cannot download NQ / HotpotQA: {why}. Copy FlashRAG's files ({HUB_REPO}) to a folder laid out as "
            "DIR/nq/train.jsonl, DIR/hotpotqa/dev.jsonl, ... and pass --from-dir DIR."
        )
    for name in datasets:
        for split in SPLITS[name]:
            if from_dir is not None:
                src = from_dir / name / f"{split}.jsonl"
                if not src.is_file():
                    raise FileNotFoundError(f"--from-dir: {src} does not exist")
            else:
                src = _download(name, split)
            dst = out / f"{name}_{split}.jsonl"
            written.append((dst, convert(src, dst, name, limit)))
    return written


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sisrl-data", description="Prepare question data for sisrl-train.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="NQ + HotpotQA (FlashRAG) -> JSONL {id, question, golden_answers, data_source}",
                       formatter_class=DefaultsHelp)
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--datasets", nargs="+", choices=sorted(SPLITS), default=sorted(SPLITS), help="which data sets")
    p.add_argument("--from-dir", type=Path, default=None, help="local FlashRAG folder (DIR/nq/train.jsonl, ...) instead of the hub")
    p.add_argument("--limit", type=int, default=None, help="keep at most this many rows per split")
    d = sub.add_parser("demo", help="write the fictional demo corpus and questions",
                       formatter_class=DefaultsHelp)
    d.add_argument("--out", type=Path, required=True, help="output folder")
    d.add_argument("--seed", type=int, default=0, help="generator seed")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        for name, path in write_demo_data(args.out, seed=args.seed).items():
            print(f"{name}: {path}")
        return 0
    if args.limit is not None and args.limit < 1:
        print(f"--limit must be >= 1, got {args.limit}", file=sys.stderr)
        return 2
    try:
        written = prepare(args.out, args.datasets, args.from_dir, args.limit)
    except (RuntimeError, FileNotFoundError, ValueError) as err:
        print(f"sisrl-data prepare: {err}", file=sys.stderr)
        return 2
    for path, count in written:
        print(f"{path}: {count} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
