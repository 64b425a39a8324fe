"""What SIS adds to a training step: time and peak memory, plain IS ratio vs SIS ratio, same run.

    .venv/bin/python bench/sis_overhead.py                      # SmolLM2-135M, 1 x 512 tokens, K = 20
    .venv/bin/python bench/sis_overhead.py --model tiny --batch 8

Time: both variants in one process, steps interleaved in alternating order so machine noise hits both alike
(median per variant). Memory: the bytes autograd saves for backward (deterministic), and the peak RSS
(VmHWM; ru_maxrss would include the parent's) of a fresh process per (variant, repetition). A step is forward +
log-prob gather + ratio + GRPO loss + backward of a real transformers causal LM. Reported: median step time and peak RSS, and SIS / plain ratios. The physical
floor of the SIS extra is the top-K gather: B * T * (K + 1) floats against the B * T * V logits tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from record import write_record
from sisrl.common.procs import peak_rss_bytes


def _step_fn(model: torch.nn.Module, input_ids: torch.Tensor, variant: str, k: int):  # noqa: ANN202
    from sisrl.trainer.losses import compute_log_ratio, get_policy_loss
    from sisrl.trainer.sis import gather_logprobs, token_and_topk_logprobs, token_in_topk

    b, t = input_ids.shape
    gen = torch.Generator().manual_seed(0)
    tokens = input_ids[:, 1:]
    vocab = model.config.vocab_size
    # Behaviour data as a rollout engine records it: log q of each token and q's top-K ids / log-probs.
    logq = torch.randn(b, t - 1, generator=gen) * 0.1 - 2.0
    topk_ids = torch.randint(0, vocab, (b, t - 1, k), generator=gen)
    topk_ids[..., 0] = tokens
    topk_logq = torch.randn(b, t - 1, k, generator=gen) * 0.1 - 3.0
    mask = torch.ones(b, t - 1)
    adv = torch.randn(b, generator=gen)
    loss_fn = get_policy_loss("grpo")

    def step() -> None:
        logits = model(input_ids=input_ids).logits[:, :-1]  # [B, T-1, V]
        if variant == "plain":
            logp = gather_logprobs(logits, tokens)
            ratio = compute_log_ratio("is", logp=logp, logq=logq, mask=mask)
        else:
            logp, topk_logp = token_and_topk_logprobs(logits, tokens, topk_ids)
            ratio = compute_log_ratio(
                "sis", logp=logp, logq=logq, mask=mask, topk_logp=topk_logp, topk_logq=topk_logq,
                in_topk=token_in_topk(tokens, topk_ids), generator=gen,
            )
        loss, _ = loss_fn(log_ratio=ratio.log_ratio, advantages=adv, mask=mask)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def _load(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor]:
    from sisrl.common.models import build_tiny_policy, load_tokenizer, resolve_policy_path

    torch.manual_seed(0)
    if args.model == "tiny":
        model = build_tiny_policy(load_tokenizer(), hidden_size=256, num_layers=4)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(resolve_policy_path(args.model), dtype=torch.float32)
    model.train()
    return model, torch.randint(0, model.config.vocab_size, (args.batch, args.tokens))


def _saved_bytes(step) -> int:  # noqa: ANN001
    """Bytes autograd keeps for backward during one step (deterministic, unlike RSS)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return total


def _child_time(args: argparse.Namespace) -> None:
    """Both variants in one process, steps interleaved (alternating order) so machine noise hits both alike."""
    model, ids = _load(args)
    steps = {v: _step_fn(model, ids, v, args.k) for v in ("plain", "sis")}
    saved = {v: _saved_bytes(steps[v]) for v in steps}  # also the warm-up
    times: dict[str, list[float]] = {"plain": [], "sis": []}
    for i in range(args.steps):
        for v in ("plain", "sis") if i % 2 == 0 else ("sis", "plain"):
            t0 = time.perf_counter()
            steps[v]()
            times[v].append(time.perf_counter() - t0)
    out = {v: {"time": statistics.median(times[v]), "saved_mib": saved[v] / 2**20} for v in steps}
    print(json.dumps({**out, "vocab": model.config.vocab_size}))


def _child_rss(args: argparse.Namespace) -> None:
    model, ids = _load(args)
    step = _step_fn(model, ids, args.variant, args.k)
    step()
    step()
    print(json.dumps({"peak_mib": peak_rss_bytes() / 2**20}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="'tiny' or a policy path/name (default: %(default)s)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=512, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--k", type=int, default=20, help="SIS top-K (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant, interleaved (default: %(default)s)")
    p.add_argument("--reps", type=int, default=3, help="processes per variant for peak RSS (default: %(default)s)")
    p.add_argument("--variant", choices=["plain", "sis", "time"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant == "time":
        _child_time(args)
        return
    if args.variant:
        _child_rss(args)
        return
    base = [sys.executable, __file__, "--model", args.model, "--batch", str(args.batch), "--tokens",
            str(args.tokens), "--k", str(args.k), "--steps", str(args.steps)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    def child(variant: str) -> dict:  # type: ignore[type-arg]
        out = subprocess.run([*base, "--variant", variant], check=True, capture_output=True, text=True, env=env)
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))

    timing = child("time")
    rss: dict[str, list[float]] = {"plain": [], "sis": []}
    for rep in range(args.reps):
        for v in ("plain", "sis") if rep % 2 == 0 else ("sis", "plain"):
            rss[v].append(child(v)["peak_mib"])
    peak = {v: statistics.median(rss[v]) for v in rss}
    vocab = int(timing["vocab"])
    print(f"model={args.model} batch={args.batch} tokens={args.tokens} K={args.k} vocab={vocab} "
          f"timed steps/variant={args.steps} rss reps={args.reps} threads={torch.get_num_threads()}")
    print("| variant | step time (s, median) | saved for backward (MiB) | peak RSS (MiB, median) |")
    print("|---|---|---|---|")
    for v in ("plain", "sis"):
        print(f"| {v} | {timing[v]['time']:.3f} | {timing[v]['saved_mib']:.1f} | {peak[v]:.0f} |")
    print(f"| sis / plain | {timing['sis']['time'] / timing['plain']['time']:.4f} | "
          f"{timing['sis']['saved_mib'] / timing['plain']['saved_mib']:.4f} | {peak['sis'] / peak['plain']:.4f} |")
    floor = args.batch * args.tokens * (args.k + 1) * 4 / 2**20
    logits = args.batch * args.tokens * vocab * 4 / 2**20
    print(f"top-K gather floor: {floor:.2f} MiB vs {logits:.0f} MiB of fp32 logits ({floor / logits:.3%})")
    ratios = {key: timing["sis"][key] / timing["plain"][key] for key in ("time", "saved_mib")}
    rss_ratio = peak["sis"] / peak["plain"]

    def figures(v: str) -> dict[str, float]:
        return {"step time s (median)": round(timing[v]["time"], 4),
                "saved for backward MiB": round(timing[v]["saved_mib"], 2), "peak RSS MiB (median)": round(peak[v], 1)}

    default = all(getattr(args, k) == p.get_default(k) for k in ("model", "batch", "tokens", "k"))
    write_record(
        bench="sis_overhead", title="SIS overhead on a training step",
        measures="What the SIS ratio adds to one training step of a real causal LM (forward, log-prob gather, "
                 "ratio, GRPO loss, backward) against the plain IS ratio: median step time with the two variants "
                 "interleaved in one process, the bytes autograd saves for backward, and the peak RSS of a fresh "
                 "process per variant and repetition. Physical floor of the SIS extra: the top-K gather, "
                 "B x T x (K + 1) floats.",
        summary=f"SIS / plain IS: step time {ratios['time']:.3f}x, saved for backward {ratios['saved_mib']:.4f}x, "
                f"peak RSS {rss_ratio:.3f}x ({args.model}, {args.batch} x {args.tokens} tokens, K = {args.k}).",
        figures={**figures("sis"), "top-K gather floor MiB": round(floor, 3), "fp32 logits MiB": round(logits, 1)},
        baseline={"what": "plain IS ratio, same process", "figures": figures("plain")},
        notes=f"vocabulary {vocab}; {args.steps} timed steps per variant, interleaved; peak RSS the median of "
              f"{args.reps} processes per variant; torch threads {torch.get_num_threads()}",
        headline={"row": "SIS overhead on a training step (SIS / plain IS)", "rank": 3,
                  "value": f"time {ratios['time']:.3f}x, peak RSS {rss_ratio:.3f}x"} if default else None)


if __name__ == "__main__":
    main()
