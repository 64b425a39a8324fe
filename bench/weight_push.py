"""One weight push: seconds and peak memory of the push before issue 44 against the sharded push in the served dtype.

Models are Qwen2.5-shaped (Qwen2Config with the 0.5B's and 1.5B's published sizes, tied embeddings), randomly
initialised on the meta device and materialised where they live (one process: the whole model; FSDP2: each rank its
own rows), so no step builds a full copy that the push would not have had to face. Each cell runs in fresh processes:

- old (the baseline, trainer/loop.py before issue 44): under FSDP2 every rank gathers the whole float32 state dict to
  CPU (`full_state_dict`; a tied head is a second copy of the embedding), then rank 0 writes it with
  `save_pretrained` (one file, that second copy included: it shares no storage with the first); in one process
  `save_pretrained` writes the model as it is (float32). Both into an `atomic_dir` (fsynced, renamed).
- new (`trainer/push.py`): bfloat16 shards of at most `--shard-mb`, each parameter gathered by every rank and kept
  by rank 0 only, one shard held at a time.

Per process: the push's wall time, and its peak RSS above the RSS it started from (VmHWM reset through
/proc/self/clear_refs just before the push; where that is refused, the process's lifetime peak, and the record
says so). The table adds 3B and 7B arithmetic from exact parameter counts (models built on the meta device).

    .venv/bin/python bench/weight_push.py                      # 0.5B and 1.5B, one process and 2-rank FSDP2
    .venv/bin/python bench/weight_push.py --sizes 0.5b --modes single
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from record import write_record
from sisrl.common.atomic import atomic_dir
from sisrl.common.models import load_tokenizer
from sisrl.common.procs import free_port, run_group
from transformers import Qwen2Config, Qwen2ForCausalLM

MB = 1 << 20
QWEN_VOCAB = 151936
# (hidden, layers, heads, kv heads, intermediate, vocab, tied): the published Qwen2.5 configs.
SHAPES: dict[str, tuple[int, int, int, int, int, int, bool]] = {
    "tiny": (64, 2, 4, 2, 128, 4096, True),
    "0.5b": (896, 24, 14, 2, 4864, QWEN_VOCAB, True),
    "1.5b": (1536, 28, 12, 2, 8960, QWEN_VOCAB, True),
    "3b": (2048, 36, 16, 2, 11008, QWEN_VOCAB, True),
    "7b": (3584, 28, 28, 4, 18944, 152064, False),
}


def qwen_config(size: str) -> Qwen2Config:
    hidden, layers, heads, kv, inter, vocab, tied = SHAPES[size]
    return Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=tied)


def param_counts(size: str) -> tuple[int, int]:
    """(parameters, largest tensor's elements) of the model, each tied tensor once (built on the meta device)."""
    with torch.device("meta"):
        model = Qwen2ForCausalLM(qwen_config(size))
    params = list(model.parameters())  # deduplicated: a tied head counts once
    return sum(p.numel() for p in params), max(p.numel() for p in params)


def build(size: str, fsdp: bool) -> torch.nn.Module:
    """The model on the meta device, sharded when `fsdp`, then materialised on CPU with N(0, 0.02) weights."""
    from sisrl.trainer.distributed import wrap_model
    from sisrl.trainer.push import unique_tensors

    with torch.device("meta"):
        model = Qwen2ForCausalLM(qwen_config(size))
    if fsdp:
        from sisrl.trainer.config import DistributedConfig
        from sisrl.trainer.distributed import init_distributed

        model = wrap_model(model, init_distributed(DistributedConfig(strategy="fsdp2"), "cpu"), "fsdp2")
    model.to_empty(device="cpu")
    if not fsdp:  # to_empty gives each module a new parameter: the head is tied to the embedding again
        model.tie_weights()
    gen = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
    with torch.no_grad():
        for _, value in unique_tensors(model):
            local = value.to_local() if hasattr(value, "to_local") else value
            local.normal_(0.0, 0.02, generator=gen)
    return model


def old_push(model: torch.nn.Module, out: Path, *, fsdp: bool, is_main: bool) -> None:
    """The push before issue 44: a full float32 CPU state dict on every rank (FSDP2), save_pretrained on rank 0."""
    state = ({name: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().contiguous()
              for name, v in model.state_dict().items()} if fsdp else None)
    if is_main:
        with atomic_dir(out, overwrite=True) as tmp:
            model.save_pretrained(tmp, safe_serialization=True, state_dict=state)  # type: ignore[operator]
            load_tokenizer().save_pretrained(tmp)


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs); False where that is refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One push in this process (a rank under torchrun, or the single process); returns its figures."""
    from sisrl.trainer.push import write_push

    fsdp = args.mode == "fsdp2"
    torch.set_num_threads(1 if fsdp else 2)
    model = build(args.size, fsdp)
    rank = int(os.environ.get("RANK", "0"))
    out = Path(args.out) / "push"
    tokenizer = load_tokenizer()
    if fsdp:
        torch.distributed.barrier()
    start_kb = _status_kb("VmRSS")
    reset = _reset_peak()
    t0, c0 = time.perf_counter(), time.process_time()
    if args.path == "old":
        old_push(model, out, fsdp=fsdp, is_main=rank == 0)
    else:
        write_push(model, tokenizer, out, dtype=torch.bfloat16, max_shard_bytes=args.shard_mb * MB, is_main=rank == 0)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    peak_kb = _status_kb("VmHWM")
    files = sorted(out.glob("*.safetensors")) if rank == 0 else []
    if fsdp:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return {"rank": rank, "push_s": seconds, "push_cpu_s": cpu_seconds, "start_rss_mb": start_kb / 1024,
            "push_peak_rss_mb": (peak_kb - start_kb) / 1024, "peak_reset": reset,
            "weight_bytes": sum(f.stat().st_size for f in files), "files": len(files)}


def run_cell(size: str, mode: str, path: str, shard_mb: int, workdir: Path) -> list[dict[str, Any]]:
    """Fresh process(es) for one (size, mode, path); each rank's figures."""
    out = Path(tempfile.mkdtemp(prefix=f"{size}-{mode}-{path}-", dir=workdir))
    script = [str(Path(__file__).resolve()), "--worker", "--size", size, "--mode", mode, "--path", path,
              "--shard-mb", str(shard_mb), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1" if mode == "fsdp2" else "2", "MASTER_ADDR": "127.0.0.1"}
    if mode == "fsdp2":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), *script]
    else:
        cmd = [sys.executable, *script]
    try:
        proc = run_group(cmd, env=env, timeout_s=3600)  # a failed or interrupted cell leaves no rank behind
        if proc.returncode != 0:
            raise SystemExit(f"bench/weight_push.py: {size} {mode} {path} failed:\n{proc.stderr[-3000:]}")
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2 if mode == "fsdp2" else 1)]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def fits(size: str, mode: str) -> tuple[bool, str]:
    """Whether the old path of this cell fits in the memory free now, with a 25 % margin (its larger need): in one
    process the model; under FSDP2 each rank's half plus its full float32 copy."""
    params, _ = param_counts(size)
    need = params * 4 * (1 if mode == "single" else 2 * 1.5)
    avail = _meminfo_kb("MemAvailable") * 1024
    return need * 1.25 <= avail, f"needs ~{need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"


def _meminfo_kb(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/meminfo has no {key}")


def arithmetic_rows(size: str, shard_mb: int) -> list[list[Any]]:
    """Bytes per push and per-rank copies from the parameter count: the old path holds a full float32 copy on
    every rank (a tied head a second time) and writes it; the new one holds one shard plus one float32 tensor on
    rank 0 and one float32 tensor elsewhere, and writes bf16."""
    params, largest = param_counts(size)
    full = (params + (largest if SHAPES[size][6] else 0)) * 4 / MB  # the embedding is the largest tensor
    old = ["old, FSDP2 (arithmetic)", None, None, full, full, full, 1]
    new = ["new, FSDP2 (arithmetic)", None, None, (shard_mb * MB + largest * 4) / MB, largest * 4 / MB, params * 2 / MB,
           -(-params * 2 // (shard_mb * MB))]
    return [[size, round(params / 1e6), *(round(c, 1) if isinstance(c, float) else c for c in row)]
            for row in (old, new)]


def measured_row(size: str, mode: str, path: str, ranks: list[dict[str, Any]]) -> list[Any]:
    params, _ = param_counts(size)
    rank1 = round(ranks[1]["push_peak_rss_mb"], 1) if len(ranks) > 1 else None
    return [size, round(params / 1e6), f"{path}, {'2-rank FSDP2' if mode == 'fsdp2' else 'one process'}",
            round(ranks[0]["push_s"], 2), round(ranks[0]["push_cpu_s"], 2), round(ranks[0]["push_peak_rss_mb"], 1),
            rank1,
            round(ranks[0]["weight_bytes"] / MB, 1), ranks[0]["files"]]


def cell_figures(size: str, mode: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    key = f"{size.replace('.', '_')}_{mode}"
    figures = {f"{key}_push_s": round(ranks[0]["push_s"], 3), f"{key}_push_cpu_s": round(ranks[0]["push_cpu_s"], 3),
               f"{key}_rank0_peak_mb": round(ranks[0]["push_peak_rss_mb"], 1),
               f"{key}_weight_mb": round(ranks[0]["weight_bytes"] / MB, 1)}
    if len(ranks) > 1:
        figures[f"{key}_rank1_peak_mb"] = round(ranks[1]["push_peak_rss_mb"], 1)
    return figures


def summary(res: dict[tuple[str, str, str], list[dict[str, Any]]]) -> str:
    """One sentence from the largest measured cell of each mode."""
    parts = []
    for mode, what in (("single", "in one process"), ("fsdp2", "under 2-rank FSDP2")):
        sizes = [s for s in SHAPES if (s, mode, "old") in res and (s, mode, "new") in res]
        if not sizes:
            continue
        size = sizes[-1]
        old, new = res[(size, mode, "old")], res[(size, mode, "new")]
        peak = max(r["push_peak_rss_mb"] for r in old), max(r["push_peak_rss_mb"] for r in new)
        ratio = old[0]["weight_bytes"] / new[0]["weight_bytes"]
        parts.append(f"{what} ({size}-shaped) the bf16 shards are {ratio:.1f}x fewer bytes, rank 0's push takes "
                     f"{new[0]['push_cpu_s']:.1f} CPU s against {old[0]['push_cpu_s']:.1f} and the largest "
                     f"per-process peak is {peak[1]:.0f} MB against {peak[0]:.0f} MB")
    text = "; ".join(parts)
    return text[:1].upper() + text[1:] + "." if parts else "No cell was measured."


def report(args: argparse.Namespace, res: dict[tuple[str, str, str], list[dict[str, Any]]],
           skipped: list[tuple[str, str, str]], reset_ok: bool) -> None:
    columns = ["model", "params (M)", "path", "push s", "push CPU s", "rank 0 peak MB", "rank 1 peak MB",
               "weights MB", "files"]
    rows = [measured_row(size, mode, path, ranks) for (size, mode, path), ranks in res.items()]
    rows += [[size, None, f"old, {'2-rank FSDP2' if mode == 'fsdp2' else 'one process'}: skipped ({why})", None,
              None, None, None, None, None] for size, mode, why in skipped]
    for size in ("0.5b", "1.5b", "3b", "7b") if args.sizes != ["tiny"] else ["tiny"]:
        rows += arithmetic_rows(size, args.shard_mb)
    for row in rows:
        print(" | ".join("" if c is None else str(c) for c in row))  # noqa: T201
    figures: dict[str, Any] = {}
    baseline: dict[str, Any] = {}
    for (size, mode, path), ranks in res.items():
        (figures if path == "new" else baseline).update(cell_figures(size, mode, ranks))
    notes = (f"Shards of at most {args.shard_mb} MiB; peak MB = the push's peak RSS above the RSS it started from"
             + ("" if reset_ok else " (VmHWM could not be reset: lifetime peaks minus the start RSS)")
             + "; arithmetic rows: bytes each rank holds at most (old: the full float32 copy; new: rank 0 one "
             "shard + the largest float32 tensor, other ranks the largest float32 tensor) and bytes per push. "
             "Under FSDP2 the old path also wrote the tied lm_head a second time (its gathered copies share no "
             "storage, so save_pretrained cannot see the tie). Under FSDP2 a measured peak also holds the "
             "all-gather's own buffers (about twice the largest tensor), which the arithmetic rows do not count. "
             + (args.notes or ""))
    write_record(
        bench="weight_push", title="Weight push: the full float32 state dict against bf16 shards",
        measures="One weight push of a randomly initialised Qwen2.5-shaped model (tied embeddings), each cell in "
                 "fresh processes: the push before issue 44 (FSDP2: a full float32 CPU copy on every rank, then "
                 "save_pretrained) against trainer/push.py (bfloat16 shards, each parameter gathered and kept by "
                 "rank 0 only); wall and CPU time incl. fsync, peak RSS above the start, bytes written.",
        summary=summary(res), figures=figures,
        baseline={"what": "the push before issue 44 (full float32 state dict, save_pretrained), same run",
                  "figures": baseline},
        table={"columns": columns, "rows": rows}, notes=notes.strip(), results_dir=args.results_dir,
        command="bench/weight_push.py " + " ".join(sys.argv[1:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["0.5b", "1.5b"], choices=sorted(SHAPES), help="model shapes")
    p.add_argument("--modes", nargs="+", default=["single", "fsdp2"], choices=["single", "fsdp2"])
    p.add_argument("--shard-mb", type=int, default=1024, help="largest shard of the new path, MiB")
    p.add_argument("--workdir", type=Path, default=None, help="where pushes are written (default: a temp dir)")
    p.add_argument("--results-dir", type=Path, default=None, help="record folder (default: bench/results)")
    p.add_argument("--notes", default="", help="appended to the record's notes (load on the machine, ...)")
    p.add_argument("--replay", type=Path, default=None, help="write the record from a cells.json that an "
                   "interrupted run left in its --workdir (the cells it finished), running nothing")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        figures = worker(args)
        (Path(args.out) / f"rank{figures['rank']}.json").write_text(json.dumps(figures))
        return
    if args.replay:
        cells = json.loads(args.replay.read_text())
        res = {tuple(c["cell"]): c["ranks"] for c in cells["done"]}
        report(args, res, [tuple(s) for s in cells["skipped"]], all(r["peak_reset"] for v in res.values() for r in v))
        return
    res, skipped = {}, []
    with tempfile.TemporaryDirectory(prefix="weight_push-", dir=args.workdir) as tmp:
        for size in args.sizes:
            for mode in args.modes:
                ok, why = fits(size, mode)
                if not ok:  # the new path holds a fraction of it: measured alone, the old one by arithmetic
                    skipped.append((size, mode, why))
                    print(f"{size} {mode}: old path skipped, it {why}", flush=True)  # noqa: T201
                for path in ("old", "new") if ok else ("new",):
                    res[(size, mode, path)] = run_cell(size, mode, path, args.shard_mb, Path(tmp))
                    print(size, mode, path, res[(size, mode, path)], flush=True)  # noqa: T201
                    if args.workdir:  # what --replay reads if this run is cut short
                        (args.workdir / "cells.json").write_text(json.dumps(
                            {"done": [{"cell": list(k), "ranks": v} for k, v in res.items()], "skipped": skipped}))
    report(args, res, skipped, all(r["peak_reset"] for ranks in res.values() for r in ranks))


if __name__ == "__main__":
    main()
