"""A vLLM worker extension that loads a safetensors Hugging Face directory into the running model.

Pass it to vLLM as `--worker-extension-cls sisrl.services.engines.vllm_worker.SafetensorsReload` (server) or
`worker_extension_cls=` (in-process); call it with `collective_rpc("sisrl_load_safetensors", kwargs={"path": ...})`
(over HTTP: `POST /collective_rpc` with `VLLM_SERVER_DEV_MODE=1`), then reset the prefix cache. This module
never imports vllm, so it loads anywhere.

Why the worker's own `reload_weights`: after the first load vLLM post-processes some layers for its kernels
(`process_weights_after_loading`; the CPU build repacks every linear weight), so the parameters that
`model.load_weights` writes into no longer have checkpoint shapes (`Attempted to load weight
(torch.Size([576, 1536])) into parameter (torch.Size([0]))`). `Worker.reload_weights(weights_iterator=...,
is_checkpoint_format=True)` restores the checkpoint layout, loads, and post-processes again. A load that fails
half-way leaves the model unusable (vLLM's own `reload_weights` with a bad path killed the engine with
`EngineDeadError`), so the checkpoint is checked first from its safetensors headers (no tensor data read):
names and shapes against the checkpoint the engine started from, every shard its index names present and of
the size its header says. A refused checkpoint raises before any weight is touched. The tensors then stream
into `reload_weights` one at a time, shard after shard (`iter_safetensors`): the worker never holds a second
full copy of the weights.

Tied embeddings: vLLM's layerwise reload processes a tied parameter for one of its layers only
(`vllm/model_executor/model_loader/reload/__init__.py`, limitation 2). The tensor is shared, but the CPU
build's `lm_head` keeps the GEMM handle it packed from the old embedding at start-up (`dispatch_cpu_unquantized_gemm`),
so a reload would change the inputs' embeddings and not the output layer (log-probs then come out ~0.12 off the
new weights). After the reload the head's own post-load processing runs again (a no-op on GPU).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sisrl.services.engines.weights import check_like, iter_safetensors, safetensors_shapes

log = logging.getLogger(__name__)
TIED = "lm_head.weight"  # absent from checkpoints of models with tied embeddings (save_pretrained drops it)


class SafetensorsReload:
    """Mixed into each vLLM worker, which provides `model_config` and `reload_weights`."""

    def sisrl_load_safetensors(self, path: str) -> int:
        """Load every tensor of `path` into the worker's model; returns how many tensors were loaded.

        FileNotFoundError / ValueError (nothing loaded) for a missing, unreadable or mismatched checkpoint.
        """
        reload: Any = getattr(self, "reload_weights", None)
        config: Any = getattr(self, "model_config", None)
        if reload is None or config is None:
            raise RuntimeError("SafetensorsReload must be a vLLM (>= 0.32) worker extension: no reload_weights")
        shapes = safetensors_shapes(path)
        served = str(config.model)
        if Path(served).is_dir():
            check_like(shapes, safetensors_shapes(served), optional={TIED})
        else:  # a hub id: no local checkpoint to compare with; vLLM's own loader checks shapes while it loads
            log.warning("served model %s is not a local directory; %s is loaded without a shape check", served, path)
        reload(weights_iterator=iter_safetensors(path), is_checkpoint_format=True)
        if getattr(config.hf_config, "tie_word_embeddings", False):
            _repack_tied_head(getattr(self, "model_runner", None))
        return len(shapes)


def _repack_tied_head(runner: Any) -> None:
    """Re-run `lm_head`'s post-load processing so it packs the (shared) embedding as it is now."""
    model = runner.get_model() if runner is not None else None
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)
