"""The trainer's update at the GPU recipe's model shapes: tokens/s, peak memory and model FLOPs utilisation.

Random-init Qwen2-architecture models with the real shapes of Qwen2.5-0.5B and Qwen2.5-3B (151,936-token
vocabulary, tied embeddings, grouped-query attention), in the recipe's layout: fp32 master weights and AdamW,
bf16 autocast, gradient checkpointing, the trainer's own log-prob path (`policy_logits` + chunked
`gather_logprobs`) and one AdamW step per micro-batch. Each shape runs `--warmup` untimed steps, then `--steps`
timed ones, on batches shaped like search trajectories (`--prompt` + `--response` tokens, a quarter of the
response the policy's own). Model FLOPs per token: 6 x parameters (forward and backward) plus the attention
term 12 x layers x hidden x sequence; MFU against `--peak-tflops` (H100/H200 SXM dense bf16: 989).

    .venv/bin/python bench/gpu_check.py                              # CUDA, 0.5b and 3b (bench/gpu_check.sh)
    .venv/bin/python bench/gpu_check.py --device cpu --shapes tiny   # the code path on a CPU, in seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from record import write_record
from sisrl.common.hardware import cpu_model
from sisrl.trainer.policy import policy_logits
from sisrl.trainer.sis import gather_logprobs
from transformers import Qwen2Config, Qwen2ForCausalLM
from update_cost import make_batch

# Qwen2.5's published config.json values (hidden, intermediate, layers, heads, kv heads); the vocabulary of all
SHAPES = {
    "tiny": (128, 256, 2, 2, 1),
    "0.5b": (896, 4864, 24, 14, 2),
    "1.5b": (1536, 8960, 28, 12, 2),
    "3b": (2048, 11008, 36, 16, 2),
}
VOCAB = 151936


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--shapes", nargs="+", default=["0.5b", "3b"], choices=list(SHAPES), help="model shapes")
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens per sequence")
    p.add_argument("--response", type=int, default=1536, help="response tokens per sequence (sampled + inserted)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per shape")
    p.add_argument("--steps", type=int, default=3, help="timed steps per shape")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense bf16 peak, for MFU")
    p.add_argument("--chunk", type=int, default=256, help="log-prob chunk size over time (model.logprob_chunk_size)")
    p.add_argument("--results-dir", type=Path, default=None, help="record folder root (default bench/results)")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu --shapes tiny for the code path)")
    return args


def build(shape: str, device: torch.device) -> Qwen2ForCausalLM:
    hidden, inter, layers, heads, kv = SHAPES[shape]
    vocab = 4096 if shape == "tiny" else VOCAB
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=True,
                         max_position_embeddings=32768)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    return model.train()


def measure(args: argparse.Namespace, shape: str) -> dict[str, float | None]:
    device = torch.device(args.device)
    model = build(shape, device)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    cfg = model.config
    b = make_batch(args.batch, args.prompt, args.response, 0.25, cfg.vocab_size, 20)
    b = b.__class__(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(b).items()})
    seq = args.prompt + args.response
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits, view = policy_logits(model, b)
            logp = gather_logprobs(logits, view.response_ids, 1.0, args.chunk)
        loss = -(torch.where(view.mask > 0, logp, 0.0)).sum() / view.mask.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens = args.batch * seq
    flops_per_token = 6 * params + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq
    achieved = flops_per_token * tokens / step_s
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"params_b": params / 1e9, "step_s": step_s, "tokens_per_s": tokens / step_s, "peak_gib": peak_gib,
            "tflops": achieved / 1e12, "mfu": achieved / (args.peak_tflops * 1e12)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    where = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else f"CPU: {cpu_model()}"
    rows = []
    for shape in args.shapes:
        m = measure(args, shape)
        rows.append([shape] + [None if m[k] is None else round(float(m[k]), n)  # type: ignore[arg-type]
                               for k, n in (("params_b", 3), ("step_s", 3), ("tokens_per_s", 1), ("peak_gib", 2),
                                            ("tflops", 2), ("mfu", 4))])
        print(f"{shape}: {rows[-1][1:]} (parameters B, s a step, tokens/s, peak GiB, TFLOPS, MFU)", file=sys.stderr)
    cols = ["shape", "parameters (B)", "s per step", "tokens/s", "peak GiB", "TFLOPS", "MFU"]
    last = rows[-1]
    write_record(
        bench="gpu_check", title="The trainer's update at the GPU recipe's model shapes",
        measures="One micro-batch forward + backward + AdamW step of a random-init Qwen2-architecture model with "
                 "Qwen2.5's shapes (fp32 master weights, bf16 autocast on CUDA, gradient checkpointing, the "
                 "trainer's log-prob path), median of the timed steps; model FLOPs 6N + attention per token.",
        summary=f"On {where}, the {last[0]}-shaped model trains at {last[3]:.0f} tokens/s (MFU {last[6]:.1%}, peak "
                f"{last[4]} GiB; none on a CPU) on {args.batch} x {args.prompt + args.response}-token sequences.",
        figures={f"tokens/s: {r[0]}": r[3] for r in rows} | {f"MFU: {r[0]}": r[6] for r in rows}
        | {f"peak GiB: {r[0]}": r[4] for r in rows},
        baseline=None, table={"columns": cols, "rows": rows},
        notes=f"device {where}; batch {args.batch} x ({args.prompt} prompt + {args.response} response tokens); "
              f"{args.warmup} warm-up and {args.steps} timed steps; peak {args.peak_tflops} TFLOPS for MFU",
        results_dir=args.results_dir)


if __name__ == "__main__":
    main()
