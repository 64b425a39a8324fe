"""The local engine on agent-shaped traffic: prefix cache off (the baseline) vs on.

Workload, as the gateway sends it: `--groups` questions x `--samples` samples (a GRPO batch), `--turns` turns;
turn 1 is the chat prompt, each next turn is the previous prompt + the generated tokens + an observation of
`--observation` tokens (a retrieved passage). Every request of a turn is sent at once, as the agent loop does.
Both variants run SmolLM2-135M-Instruct in fp32 with the same seeds in one process; the table gives wall seconds
(median of `--repeats`), the prompt tokens the engine did not prefill again, and the speed-up.

    .venv/bin/python bench/engine_prefix.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch
from record import write_record
from sisrl.common.hardware import cpu_model
from sisrl.common.models import load_tokenizer, smollm2_dir
from sisrl.services.engines.base import SamplingParams
from sisrl.services.engines.local import LocalEngine
from transformers import AutoModelForCausalLM

PASSAGE = ('Doc 1(Title: "Pufil Maeszhes") Pufil Maeszhes (born 1846) was an astronomer from Peiholm. Pufil worked '
           'in the river delta for most of their life. Doc 2(Title: "Peiholm") Peiholm is a small town in the amber '
           'plains. It was founded in 1231 and is known for its market. ')


async def workload(engine: LocalEngine, prompts: list[list[int]], observation: list[int], args: argparse.Namespace) -> None:
    contexts = [list(p) for p in prompts for _ in range(args.samples)]
    for turn in range(args.turns):
        params = [SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, stop=(), seed=1000 * turn + i,
                                 logprobs_k=20) for i in range(len(contexts))]
        gens = await asyncio.gather(*[engine.generate(c, q) for c, q in zip(contexts, params, strict=True)])
        contexts = [c + g.token_ids + observation for c, g in zip(contexts, gens, strict=True)]


def run(model: AutoModelForCausalLM, tokenizer: object, cache_tokens: int, prompts: list[list[int]],
        observation: list[int], args: argparse.Namespace) -> tuple[float, int]:
    async def main() -> tuple[float, int]:
        engine = LocalEngine(model, tokenizer=tokenizer, prefix_cache_tokens=cache_tokens)  # type: ignore[arg-type]
        try:
            t0 = time.perf_counter()
            await workload(engine, prompts, observation, args)
            return time.perf_counter() - t0, engine.stats.prefix_reused_tokens
        finally:
            await engine.close()

    return asyncio.run(main())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--observation", type=int, default=80)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    tokenizer = load_tokenizer(smollm2_dir())
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Answer the question below, searching with "
                                            f"<search> query </search> when knowledge is missing. Question {i}: in "
                                            f"which year was the home town of person {i} founded?"}],
                                          add_generation_prompt=True, tokenize=False) for i in range(args.groups)]
    prompts = [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    observation = list(tokenizer.encode(PASSAGE * 2))[: args.observation]
    results: dict[str, list[tuple[float, int]]] = {"prefix cache off": [], "prefix cache on": []}
    for _ in range(args.repeats):
        results["prefix cache off"].append(run(model, tokenizer, 0, prompts, observation, args))
        results["prefix cache on"].append(run(model, tokenizer, 8192, prompts, observation, args))
    base = statistics.median(t for t, _ in results["prefix cache off"])
    print(f"CPU: {cpu_model()}; torch threads {torch.get_num_threads()}; {args.groups} questions x {args.samples} "  # noqa: T201
          f"samples x {args.turns} turns, {args.new_tokens} new tokens per turn, {args.observation}-token observations; "
          f"median of {args.repeats}")
    print("| variant | wall s | prompt tokens not prefilled again | speed-up |\n|---|---|---|---|")  # noqa: T201
    figures: dict[str, dict[str, float]] = {}
    for name, rows in results.items():
        med = statistics.median(t for t, _ in rows)
        print(f"| {name} | {med:.1f} | {rows[0][1]} | {base / med:.2f}x |")  # noqa: T201
        figures[name] = {"wall s (median)": round(med, 2), "prompt tokens not prefilled again": rows[0][1]}
    speed_up = base / figures["prefix cache on"]["wall s (median)"]
    write_record(
        bench="engine_prefix", title="Local engine: prefix cache on agent traffic",
        measures="Wall seconds of the local engine (SmolLM2-135M-Instruct, fp32) on agent-shaped traffic: GRPO "
                 "groups of samples over several turns, each turn the previous context + the generated tokens + an "
                 "observation; prefix cache on (the default) against off, same seeds, one process.",
        summary=f"The prefix cache runs the workload {speed_up:.2f}x faster, not prefilling "
                f"{figures['prefix cache on']['prompt tokens not prefilled again']:,} prompt tokens again.",
        figures={**figures["prefix cache on"], "speed-up": round(speed_up, 3)},
        baseline={"what": "prefix cache off (prefix_cache_tokens=0), same process", "figures": figures["prefix cache off"]},
        notes=f"{args.groups} questions x {args.samples} samples x {args.turns} turns, {args.new_tokens} new tokens "
              f"per turn, {args.observation}-token observations; median of {args.repeats}; torch threads "
              f"{torch.get_num_threads()}")


if __name__ == "__main__":
    main()
