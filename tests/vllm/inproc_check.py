"""Run by tests/vllm/test_vllm_cpu.py with the vLLM venv's interpreter: the in-process engine (`VLLMEngine`).

It generates, loads a new checkpoint, is refused a bad one, loads the original back and closes; the results go
to stdout as one JSON object (the test compares them with the HTTP server's and checks stderr for errors).

    <vllm venv>/bin/python tests/vllm/inproc_check.py MODEL_DIR NEW_DIR BAD_DIR PROMPT_IDS_JSON
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict
from typing import Any

from sisrl.services.engines.base import SamplingParams, create_engine

PARAMS = SamplingParams(max_new_tokens=16, temperature=1.0, seed=11, logprobs_k=20, stop=())


async def check(model: str, new: str, bad: str, prompt: list[int]) -> dict[str, Any]:
    engine: Any = create_engine("vllm", model=model, dtype="float32", enforce_eager=True, max_model_len=1024)
    try:
        out: dict[str, Any] = {"before": asdict(await engine.generate(prompt, PARAMS))}
        await engine.load_weights(new, 1)
        out["after"] = asdict(await engine.generate(prompt, PARAMS))
        try:
            await engine.load_weights(bad, 2)
        except Exception as exc:  # any failure: the test reads its message
            out["bad_error"] = f"{type(exc).__name__}: {exc}"
        out["after_bad"] = asdict(await engine.generate(prompt, PARAMS))
        out["version_after_bad"] = engine.policy_version
        await engine.load_weights(model, 3)
        out["restored"] = asdict(await engine.generate(prompt, PARAMS))
        out["version"] = engine.policy_version
    finally:
        await engine.close()
    return out


def main() -> None:
    model, new, bad, prompt = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    result = asyncio.run(check(model, new, bad, prompt))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
