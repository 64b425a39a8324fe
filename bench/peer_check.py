"""Is bench/baseline_retriever.py faithful? It against the real Search-R1 server, same index, encoder and workloads.

bench/retriever.py measures sisrl against bench/baseline_retriever.py, which behaves like Search-R1's
`retrieval_server.py` without its code. This bench checks that stand-in against the real thing: Search-R1's own
server file (from a checkout: `git clone https://github.com/PeterGriffinJin/Search-R1`), run on a CPU by
bench/search_r1_cpu.py (its `.cuda()` / `.half()` made no-ops, nothing else changed), over the same sisrl index
(`index.faiss`, `docs.jsonl`, the encoder directory the manifest names). The servers run one at a time with
bench/retriever.py's workloads (a)-(d) and question pool; then the top-3 passages of 100 nq/dev questions must be
the same on both, and each server's recall@k is printed. Ratios are baseline / Search-R1 (q/s) and Search-R1 /
baseline (p99): near 1.0 means the stand-in costs what the real server costs.

    .venv/bin/python bench/peer_check.py --index /tmp/bench3k --search-r1 ~/Search-R1 --seconds 30
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import httpx
from record import write_record
from sisrl.common.hardware import cpu_model
from sisrl.retriever.eval import load_questions
from sisrl.retriever.manifest import load_manifest


def _load(filename: str) -> ModuleType:
    """A file of bench/ loaded by path (`retriever` is also sisrl's package): bench/retriever.py's workloads,
    question pool, clients and the Search-R1 server's command line."""
    name = "bench_" + filename.removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(filename))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def top3(url: str, questions: list[str]) -> list[list[str]]:
    # return_scores true: Search-R1's handler unpacks (results, scores) either way, so false gets a 500 there
    body = {"queries": questions, "topk": 3, "return_scores": True}
    rows = httpx.post(f"{url}/retrieve", json=body, timeout=600).raise_for_status().json()["result"]
    return [[item["document"]["id"] for item in row] for row in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", type=Path, required=True, help="a sisrl flat index directory (required)")
    parser.add_argument("--search-r1", type=Path, required=True,
                        help="a Search-R1 checkout, or its search_r1/search/retrieval_server.py (required)")
    bench = _load("retriever.py")
    bench.add_workload_args(parser)
    parser.add_argument("--port", type=int, default=18700, help="first of two ports used (default: %(default)s)")
    args = parser.parse_args()
    peer_cmd = bench.search_r1_command(parser, args)  # on args.port + 1
    manifest = load_manifest(args.index)
    args.questions = bench.DATA / "nq" / "dev.jsonl"
    pool = bench.QueryPool([p for p in bench.POOL_FILES if p.is_file()])
    workdir = args.index.parent / f".{args.index.name}-peer"
    workdir.mkdir(exist_ok=True)
    questions = [q.question for q in load_questions(args.questions, limit=100)]
    base_url, peer_url = f"http://127.0.0.1:{args.port}", f"http://127.0.0.1:{args.port + 1}"
    here = Path(__file__).resolve().parent
    base_cmd = [sys.executable, str(here / "baseline_retriever.py"), "--index", str(args.index),
                "--port", str(args.port)]
    results, tops = {}, {}
    for name, command, url in (("baseline", base_cmd, base_url), ("Search-R1", peer_cmd, peer_url)):
        service = bench.start(name, command, url, workdir / f"{name}-top3.log", args.threads)
        try:
            tops[name] = top3(url, questions)
        finally:
            service.stop(timeout_s=60)
        results[name] = bench.bench_server(name, command, url, pool, args, workdir)
    print(f"CPU: {cpu_model()}; index {args.index} ({manifest.count} passages, {manifest.encoder.model})")
    for line in bench.table(results["baseline"], results["Search-R1"], names=("baseline", "Search-R1")):
        print(line)
    same = sum(a == b for a, b in zip(tops["baseline"], tops["Search-R1"], strict=True))
    print(f"identical top-3 on {same}/{len(questions)} nq/dev questions")
    none = (0.0, 0.0)  # no FLOP count here
    mine = {k: v for k, v in bench.run_figures(results["baseline"], none).items() if "encoder" not in k}
    theirs = {k: v for k, v in bench.run_figures(results["Search-R1"], none).items() if "encoder" not in k}
    write_record(
        bench="peer_check", title="The stand-in baseline against the real Search-R1 server",
        measures="bench/baseline_retriever.py (the stand-in bench/retriever.py compares sisrl with) against "
                 "Search-R1's own retrieval_server.py run on the CPU by bench/search_r1_cpu.py: the same index, "
                 "encoder and workloads (a)-(d), one server at a time, then the top-3 of 100 nq/dev questions on "
                 "both. Near 1.0 everywhere means the stand-in costs what the real server costs.",
        summary=f"The stand-in ran (a) at {mine['(a) q/s'] / theirs['(a) q/s']:.2f}x and (d) at "
                f"{mine['(d) req/s'] / theirs['(d) req/s']:.2f}x the real server's rate, with the same top-3 on "
                f"{same}/{len(questions)} questions.",
        figures={**mine, "identical top-3": f"{same}/{len(questions)}"},
        baseline={"what": "Search-R1's own server, same run", "figures": theirs},
        notes=f"index {args.index.name} ({manifest.count} passages, {manifest.encoder.model}); (c) {args.clients} "
              f"clients, (d) {args.many_clients}, {args.seconds:g} s each")
    return 0 if same == len(questions) else 1


if __name__ == "__main__":
    sys.exit(main())
