"""A vLLM worker extension that loads a safetensors Hugging Face directory into the running model.

Pass it to vLLM as `--worker-extension-cls sisrl.services.engines.vllm_worker.SafetensorsReload` (server) or
`worker_extension_cls=` (in-process); call it with `collective_rpc("sisrl_load_safetensors", kwargs={"path": ...})`
(over HTTP: `POST /collective_rpc` with `VLLM_SERVER_DEV_MODE=1`), then reset the prefix cache. vLLM models
accept `(name, tensor)` pairs in Hugging Face naming through `model.load_weights` and handle fused layers and
sharding themselves. This module never imports vllm, so it loads anywhere.
"""

from __future__ import annotations

from typing import Any

from sisrl.services.engines.weights import read_safetensors


class SafetensorsReload:
    """Mixed into each vLLM worker; `self.model_runner` is the worker's model runner."""

    def sisrl_load_safetensors(self, path: str) -> int:
        """Load every tensor of `path` into the worker's model; returns how many tensors were read."""
        state = read_safetensors(path)
        runner: Any = getattr(self, "model_runner", None)
        if runner is None:
            raise RuntimeError("SafetensorsReload must be used as a vLLM worker extension (no model_runner)")
        runner.model.load_weights(weights=state.items())
        return len(state)
