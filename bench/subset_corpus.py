"""A benchmark corpus from ../shared/data: every nq/dev gold passage plus `--others` other passages (seeded), in
corpus order, so recall on nq/dev through a server over it means something.

    .venv/bin/python bench/subset_corpus.py --others 2503 --out /tmp/bench3k.jsonl   # 3,000 passages
    .venv/bin/python -m sisrl.retriever.cli build --corpus /tmp/bench3k.jsonl --out /tmp/bench3k
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--others", type=int, default=2503, help="passages besides the gold ones (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="which others (default: %(default)s)")
    parser.add_argument("--data", type=Path, default=DATA, help="shared data directory (default: %(default)s)")
    parser.add_argument("--out", type=Path, required=True, help="JSONL corpus to write (required)")
    args = parser.parse_args()
    gold = {pid for line in (args.data / "nq" / "dev.jsonl").open(encoding="utf-8")
            for pid in json.loads(line)["metadata"]["gold_passage_ids"]}
    lines = (args.data / "corpus" / "wiki_passages.jsonl").read_text(encoding="utf-8").splitlines()
    ids = [json.loads(line)["id"] for line in lines]
    others = [i for i, pid in enumerate(ids) if pid not in gold]
    if args.others > len(others):
        parser.error(f"--others {args.others}: the corpus has only {len(others)} passages besides the gold ones")
    keep = {i for i, pid in enumerate(ids) if pid in gold} | set(random.Random(args.seed).sample(others, args.others))
    args.out.write_text("".join(lines[i] + "\n" for i in sorted(keep)), encoding="utf-8")
    print(f"{len(keep)} passages ({len(keep) - args.others} gold) -> {args.out}")


if __name__ == "__main__":
    main()
