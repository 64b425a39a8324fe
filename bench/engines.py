"""The local transformers engine vs a real vLLM OpenAI server: same model, dtype and sampling, in one run.

SmolLM2-135M-Instruct in float32, `--new-tokens` tokens per request at temperature 1 with K = 20 top log-probs
recorded (what the gateway asks for), batches of 1, 8 and 32 concurrent requests with fixed seeds. The table
gives generated tokens per second (median of `--repeats`) and the vLLM / local ratio. The vLLM server is started
here from the vLLM venv that `make test-vllm` builds (tests/vllm/run.py), or pass `--vllm-url` for a running one
that serves the same model as `smollm2-135m-instruct`.

    .venv/bin/python bench/engines.py [--vllm-python ~/.cache/sisrl/vllm/venv-<key>/bin/python]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch
from record import write_record
from sisrl.common.cache import user_cache_dir
from sisrl.common.hardware import cpu_model
from sisrl.common.models import SMOLLM2, load_tokenizer, smollm2_dir
from sisrl.common.procs import Service, free_port, launch, wait_healthy
from sisrl.common.vllm_cpu import server_command, server_env, sisrl_path
from sisrl.services.engines.base import Engine, SamplingParams
from sisrl.services.engines.local import LocalEngine
from sisrl.services.engines.vllm_http import VLLMHttpEngine

QUESTIONS = ["Who wrote the novel Dracula?", "What is the capital of Australia?", "Why is the sky blue?",
             "Name three prime numbers.", "When did the Berlin Wall fall?", "What do bees make?",
             "How far is the Moon?", "Who painted the Mona Lisa?"]


async def throughput(engine: Engine, prompts: list[list[int]], batch: int, new_tokens: int, seed: int) -> float:
    """Generated tokens per second for `batch` concurrent requests (prompts cycled)."""
    params = [SamplingParams(max_new_tokens=new_tokens, temperature=1.0, logprobs_k=20, stop=(), seed=seed + i)
              for i in range(batch)]
    start = time.perf_counter()
    gens = await asyncio.gather(*[engine.generate(prompts[i % len(prompts)], p) for i, p in enumerate(params)])
    return sum(len(g.token_ids) for g in gens) / (time.perf_counter() - start)


async def measure(engine: Engine, prompts: list[list[int]], args: argparse.Namespace) -> dict[int, float]:
    await throughput(engine, prompts, 2, 4, 999)  # warm-up: first-call allocations, connection set-up
    return {batch: statistics.median([await throughput(engine, prompts, batch, args.new_tokens, 100 * r)
                                      for r in range(args.repeats)]) for batch in args.batches}


def default_vllm_python() -> Path | None:
    """The newest complete venv that tests/vllm/run.py built, if any."""
    venvs = sorted(user_cache_dir("vllm").glob("venv-*/.sisrl-recipe.json"), key=lambda p: p.stat().st_mtime)
    return venvs[-1].parent / "bin" / "python" if venvs else None


def start_vllm(python: Path, log: Path) -> Service:
    port = free_port()
    command = server_command(python, str(smollm2_dir()), port=port, served_model_name=SMOLLM2)
    env = server_env(python.parents[1], sisrl_path=sisrl_path())
    service = launch("vllm", command, url=f"http://127.0.0.1:{port}", log=log, env=env)
    wait_healthy(service, timeout_s=900)
    return service


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-url", default=None, help="a running vLLM server (default: start one)")
    p.add_argument("--vllm-python", type=Path, default=None,
                   help="interpreter of a venv with vllm-cpu (default: the one `make test-vllm` built)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="concurrent requests (default: 1 8 32)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per request (default: 32)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per batch size (default: 2)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="torch threads of the local engine (default: torch's, here %(default)s)")
    args = p.parse_args()
    tokenizer = load_tokenizer()
    prompts = [[int(t) for t in tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                                               add_generation_prompt=True, return_dict=True)["input_ids"]]
               for q in QUESTIONS]
    python = args.vllm_python or default_vllm_python()
    if args.vllm_url is None and python is None:
        p.error("no vLLM venv found: run `make test-vllm` once, or pass --vllm-python / --vllm-url")
    torch.set_num_threads(args.threads)

    async def local() -> dict[int, float]:
        engine = LocalEngine(SMOLLM2, dtype="float32", max_batch_size=max(args.batches))
        try:
            return await measure(engine, prompts, args)
        finally:
            await engine.close()

    local_rates = asyncio.run(local())
    service = None
    if args.vllm_url is None:
        assert python is not None
        service = start_vllm(python, Path(tempfile.mkdtemp(prefix="bench-vllm-")) / "server.log")
    url = args.vllm_url or (service.url if service else "")

    async def served() -> dict[int, float]:
        engine = VLLMHttpEngine(url, model=SMOLLM2, retries=0)
        try:
            return await measure(engine, prompts, args)
        finally:
            await engine.close()

    try:
        vllm_rates = asyncio.run(served())
    finally:
        if service is not None:
            service.stop()
    print(f"CPU: {cpu_model()}; SmolLM2-135M-Instruct float32; {args.new_tokens} new tokens per request, "
          f"temperature 1, K = 20; local engine with {args.threads} torch threads; median of {args.repeats}")
    print("| batch | local tok/s | vLLM tok/s | vLLM / local |\n|---|---|---|---|")
    for batch in args.batches:
        print(f"| {batch} | {local_rates[batch]:.1f} | {vllm_rates[batch]:.1f} | "
              f"{vllm_rates[batch] / local_rates[batch]:.2f}x |")
    write_record(
        bench="engines", title="Local engine vs a real vLLM server",
        measures="Generated tokens/s of the local transformers engine and of a real vLLM OpenAI server on the same "
                 "SmolLM2-135M-Instruct float32 weights and sampling (temperature 1, K = 20 top log-probs, fixed "
                 "seeds), at several numbers of concurrent requests.",
        summary="vLLM / local tokens/s: " + ", ".join(f"{vllm_rates[b] / local_rates[b]:.2f}x at batch {b}"
                                                      for b in args.batches) + ".",
        figures={f"tok/s, batch {b}": round(vllm_rates[b], 1) for b in args.batches},
        baseline={"what": "the local engine, same run", "figures": {f"tok/s, batch {b}": round(local_rates[b], 1)
                                                                    for b in args.batches}},
        notes=f"{args.new_tokens} new tokens per request; median of {args.repeats}; local engine with "
              f"{args.threads} torch threads; vLLM {'at ' + args.vllm_url if args.vllm_url else 'started here'}")


if __name__ == "__main__":
    main()
