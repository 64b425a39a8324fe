"""sisrl's retriever with two option sets, in alternating pairs: (a) then (d) on a fresh server per run.

Each run starts `sisrl-retriever serve --cache-size 0 --log-level warning` with the given options on loopback,
sends 2 warm-up + 8 requests of 256 unique questions ((a), q/s), then with `--clients N` N one-query clients for
`--seconds` ((c), req/s and p99), then 200 one-query clients for `--seconds` ((d), req/s, p99/p50, and
long/short: the median latency of the longest quarter of queries over that of the shortest quarter), and stops
it; the two option sets alternate `--pairs` times so drifts of the machine hit both. The workloads, question pool
and clients are bench/retriever.py's.

    .venv/bin/python bench/retriever_pairs.py --index /tmp/bench3k --b "--encode-processes 2"
    .venv/bin/python bench/retriever_pairs.py --index /tmp/bench3k --a "--no-coalesce-early" --b "" --clients 8
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

from bench_module import bench_retriever
from record import write_record
from sisrl.common.hardware import cpu_model
from sisrl.common.procs import launch, wait_healthy

bench = bench_retriever()


def one_run(index: Path, options: list[str], seconds: float, port: int, clients: int) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}"
    pool = bench.QueryPool([path for path in bench.POOL_FILES if path.is_file()])
    command = [sys.executable, "-m", "sisrl.retriever.cli", "serve", "--index", str(index), "--port", str(port),
               "--cache-size", "0", "--log-level", "warning", *options]
    service = launch("sisrl", command, url=url, log=index.parent / f".{index.name}-pairs.log")
    try:
        wait_healthy(service, timeout_s=600)
        bench.run_batches(url, lambda: pool.take(256), 2)
        a = bench.run_batches(url, lambda: pool.take(256), 8)
        c = bench.run_clients(url, pool, clients, seconds) if clients else None
        d = bench.run_clients(url, pool, 200, seconds)
        quartiles = d.p50_by_length()
        return {"a": a.qps, "d": d.qps, "ratio": d.qps / a.qps, "p99/p50": d.pct(0.99) / d.pct(0.5),
                "long/short": quartiles[-1] / quartiles[0], "rss_mib": bench.peak_rss_mib(service.process.pid),
                **({"c": c.qps, "c_p99_ms": 1000 * c.pct(0.99)} if c is not None else {})}
    finally:
        service.stop(timeout_s=60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", type=Path, required=True, help="index directory")
    p.add_argument("--a", default="", help="serve options of set A (default: none, the defaults)")
    p.add_argument("--b", default="--encode-processes 2", help="serve options of set B (default: %(default)s)")
    p.add_argument("--pairs", type=int, default=3, help="alternating pairs (default: %(default)s)")
    p.add_argument("--seconds", type=float, default=20.0, help="duration of (d) (default: %(default)s)")
    p.add_argument("--port", type=int, default=18670)
    p.add_argument("--clients", type=int, default=0,
                   help="also (c): this many one-query clients for --seconds before (d); 0 = skip (default: %(default)s)")
    args = p.parse_args()
    sets = {"A": shlex.split(args.a), "B": shlex.split(args.b)}
    runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for _ in range(args.pairs):
        for name, options in sets.items():
            runs[name].append(one_run(args.index, options, args.seconds, args.port, args.clients))
    print(f"CPU: {cpu_model()}; index {args.index}; {args.pairs} pairs")  # noqa: T201
    c_head = f"(c) {args.clients} clients, req/s | (c) p99 ms | " if args.clients else ""
    print(f"| set | options | (a) q/s | {c_head}(d) req/s | (d)/(a) | p99/p50 | long/short p50 | peak RSS MiB |")  # noqa: T201
    print("|---" * (10 if args.clients else 8) + "|")  # noqa: T201
    for name, options in sets.items():
        def col(key: str, fmt: str, rs: list[dict[str, float]] = runs[name]) -> str:
            return " / ".join(format(r[key], fmt) for r in rs) + f" (mean {format(statistics.mean(r[key] for r in rs), fmt)})"
        c_cols = f"{col('c', '.0f')} | {col('c_p99_ms', '.0f')} | " if args.clients else ""
        print(f"| {name} | `{' '.join(options) or 'defaults'}` | {col('a', '.0f')} | {c_cols}{col('d', '.0f')} | "  # noqa: T201
              f"{col('ratio', '.2f')} | {col('p99/p50', '.2f')} | {col('long/short', '.2f')} | {col('rss_mib', '.0f')} |")
    record_pairs(args, sets, runs)
    return 0


LABELS = {"a": "(a) q/s", "c": "(c) req/s", "c_p99_ms": "(c) p99 ms", "d": "(d) req/s", "ratio": "(d) / (a)",
          "p99/p50": "(d) p99 / p50", "long/short": "(d) long / short p50", "rss_mib": "peak RSS MiB"}


def record_pairs(args: argparse.Namespace, sets: dict[str, list[str]], runs: dict[str, list[dict[str, float]]]) -> None:
    """Set B's means against set A's (the baseline, alternating with it in the same run), every run in the table."""
    def means(name: str) -> dict[str, float]:
        return {LABELS[k]: round(statistics.mean(r[k] for r in runs[name]), 3) for k in LABELS if k in runs[name][0]}

    b, a = means("B"), means("A")
    options = {name: " ".join(opts) or "defaults" for name, opts in sets.items()}
    rows = [[name, options[name], i + 1, *(round(r[k], 3) for k in LABELS if k in r)]
            for name in sets for i, r in enumerate(runs[name])]
    write_record(
        bench="retriever_pairs", title="Retriever option sets in alternating pairs",
        measures="Two option sets of sisrl-retriever serve, a fresh server per run, alternating so that drifts "
                 "of the machine hit both: (a) q/s over 8 requests of 256 questions, optionally (c) one-query "
                 "clients, then (d) 200 one-query clients (req/s, p99/p50, long/short: the median latency of the "
                 "longest quarter of queries over the shortest's), and peak RSS.",
        summary=f"`{options['B']}` against `{options['A']}`, mean of {args.pairs} pairs: (a) {b['(a) q/s']:.0f} "
                f"against {a['(a) q/s']:.0f} q/s, (d) {b['(d) req/s']:.0f} against {a['(d) req/s']:.0f} req/s.",
        figures={"options": options["B"], **b},
        baseline={"what": f"set A (`{options['A']}`), alternating in the same run",
                  "figures": {"options": options["A"], **a}},
        table={"columns": ["set", "options", "run", *(LABELS[k] for k in LABELS if k in runs["A"][0])],
               "rows": rows},
        notes=f"index {args.index.name}; (d) {args.seconds:g} s" + (f", (c) {args.clients} clients" if args.clients else ""))


if __name__ == "__main__":
    sys.exit(main())
