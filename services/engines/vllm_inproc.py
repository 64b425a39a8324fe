"""Optional in-process vLLM engine (GPU). `vllm` is imported only when the engine is built.

The engine runs with `logprobs_mode="processed_logprobs"` (log-probs of the distribution tokens were sampled
from), `generation_config="vllm"` (no model-specific sampling defaults) and the `SafetensorsReload` worker
extension for `load_weights`. vLLM's per-position log-prob dicts hold the sampled token plus the top-K, each
with its rank; we keep exactly the K entries of rank <= K.
"""

from __future__ import annotations

import importlib
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from sisrl.common.models import resolve_policy_path
from sisrl.common.vllm_cpu import WORKER_EXTENSION
from sisrl.services.engines.base import Generation, SamplingParams, check_prompt, clamp_logprob


class RankedLogprob(Protocol):
    """What vLLM's `Logprob` offers: a log-prob and a 1-based rank."""

    logprob: float
    rank: int | None


def _import_vllm() -> Any:
    try:
        return importlib.import_module("vllm")
    except ImportError as exc:
        raise ImportError(
            "engine kind 'vllm' needs the vllm package on a GPU machine (pip install 'sisrl[gpu]'); "
            "use kind 'local' on CPU or 'vllm-http' against a running vLLM server"
        ) from exc


class VLLMEngine:
    """`Engine` over vLLM's AsyncLLMEngine in this process."""

    def __init__(
        self, model: str, *, policy_version: int = 0, max_logprobs: int = 20, **engine_args: Any
    ) -> None:
        vllm = _import_vllm()
        self._vllm = vllm
        args = vllm.AsyncEngineArgs(
            model=resolve_policy_path(model),
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            max_logprobs=max_logprobs,
            worker_extension_cls=WORKER_EXTENSION,
            **engine_args,
        )
        self._engine = vllm.AsyncLLMEngine.from_engine_args(args)
        self.policy_version = policy_version

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        check_prompt(prompt_ids)
        version = self.policy_version
        sampling = self._vllm.SamplingParams(
            n=1,
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            logprobs=params.logprobs_k,
            stop=list(params.stop),
            include_stop_str_in_output=True,
            skip_special_tokens=False,
            seed=params.seed,
        )
        final = None
        async for output in self._engine.generate(
            {"prompt_token_ids": prompt_ids}, sampling, uuid.uuid4().hex
        ):
            final = output
        if final is None:
            raise RuntimeError("vLLM returned no output")
        out = final.outputs[0]
        reason = _finish_reason(out.finish_reason, out.stop_reason)
        return from_ranked_logprobs(list(out.token_ids), out.logprobs, params.logprobs_k, reason, version)

    async def load_weights(self, path: str, version: int) -> None:
        await self._engine.collective_rpc("sisrl_load_safetensors", kwargs={"path": path})
        await self._engine.reset_prefix_cache()  # cached KV was computed with the old weights
        self.policy_version = version

    async def close(self) -> None:
        self._engine.shutdown()
        # AsyncLLM.__del__ calls shutdown() again; run late, at interpreter exit, it finds vllm's module globals
        # already None and prints `TypeError: 'NoneType' object is not callable`. It has been shut down once.
        self._engine.shutdown = _already_shut_down


def _already_shut_down(timeout: float | None = None) -> None:
    """Stands in for `AsyncLLM.shutdown` after `VLLMEngine.close` (see there)."""


def _finish_reason(reason: str | None, stop_reason: int | str | None) -> str:
    if reason == "length":
        return "length"
    if reason == "stop":
        return "stop" if isinstance(stop_reason, str) else "eos"
    raise RuntimeError(f"vLLM generation ended with finish_reason={reason!r}")


def from_ranked_logprobs(
    token_ids: list[int],
    logprobs: Sequence[Mapping[int, RankedLogprob]] | None,
    k: int,
    finish_reason: str,
    policy_version: int,
) -> Generation:
    """vLLM per-position {token id: Logprob(logprob, rank)} -> Generation with exactly K top entries by rank."""
    if logprobs is None or len(logprobs) != len(token_ids):
        raise ValueError(
            f"expected one log-prob dict per token ({len(token_ids)}), got {logprobs and len(logprobs)}"
        )
    sampled, top_ids, top_lps = [], [], []
    for token, entries in zip(token_ids, logprobs, strict=True):
        sampled.append(clamp_logprob(entries[token].logprob))
        ranked = sorted(
            (e.rank, tid, e.logprob) for tid, e in entries.items() if e.rank is not None and e.rank <= k
        )
        if len(ranked) != k:
            raise ValueError(f"expected {k} entries of rank <= {k}, got {len(ranked)}")
        top_ids.append([tid for _, tid, _ in ranked])
        top_lps.append([clamp_logprob(lp) for _, _, lp in ranked])
    gen = Generation(token_ids, sampled, top_ids, top_lps, finish_reason, policy_version)
    gen.validate(k)
    return gen
