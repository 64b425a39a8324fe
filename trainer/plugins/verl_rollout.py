"""GPU half of the verl plug-in (verl 0.9.1 + vLLM): a rollout server that records q's top-K, and the wiring.

Written against verl 0.9.1's source and NOT run here (it needs vLLM and CUDA); docs/plugins.md has the recipe.
- `SISvLLMHttpServer` asks vLLM for `logprobs=K` ($SISRL_SIS_K, default 20) on every request that asks for
  log-probs, keeps verl's own sampled-token log-prob, and adds `sis_topk_ids` / `sis_topk_logq` ([T][K] lists)
  to the `TokenOutput.extra_fields`, which verl's agent loop turns into per-sample batch fields.
- `register_sis_vllm_rollout()` makes rollout name `vllm` build replicas of that server.
- `install_sis(trainer)` sets `sis_actor_loss` as the actor loss on the workers and turns on the engine's
  top-K logits-processor call (`distillation_use_topk`) for every actor update.
- `SISRayPPOTrainer` does both around `init_workers()`; `setup_worker`, given to Ray as
  `runtime_env.worker_process_setup_hook`, makes verl's (v0) TaskRunner build it, in every Ray process.
"""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator
from typing import Any

import ray
from sisrl.trainer.plugins.verl import rank_topk, sis_actor_loss
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.rollout.replica import RolloutReplicaRegistry
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica


def sis_k() -> int:
    """K of the behaviour top-K, from $SISRL_SIS_K (the server runs in its own Ray actor; pass it in the
    runtime env: `+ray_kwargs.ray_init.runtime_env.env_vars.SISRL_SIS_K=20`)."""
    k = int(os.environ.get("SISRL_SIS_K", "20"))
    if k < 1:
        raise ValueError(f"SISRL_SIS_K must be an integer >= 1, got {k}")
    return k


class SISvLLMHttpServer(vLLMHttpServer):  # type: ignore[misc]
    """verl's vLLM server with q's top-K recorded per request (verl's `generate` itself is unchanged)."""

    async def launch_server(self, *args: Any, **kwargs: Any) -> None:
        await super().launch_server(*args, **kwargs)
        self._sis_topk: dict[str, tuple[list[list[int]], list[list[float]]]] = {}
        engine = getattr(self, "engine", None)
        if engine is None:  # headless node: serves no requests
            return
        k, engine_generate = sis_k(), engine.generate

        async def generate(
            *, prompt: Any, sampling_params: Any, request_id: str, **kw: Any
        ) -> AsyncIterator[Any]:
            if (
                sampling_params.logprobs is not None
            ):  # verl asked for the sampled token's log-prob: ask for K more
                sampling_params.logprobs = k
            final = None
            async for output in engine_generate(
                prompt=prompt, sampling_params=sampling_params, request_id=request_id, **kw
            ):
                final = output
                yield output
            if final is not None and final.outputs and final.outputs[0].logprobs:
                self._sis_topk[request_id] = rank_topk(final.outputs[0].logprobs, k)

        engine.generate = generate

    async def generate(  # type: ignore[override]  # same call shape as verl 0.9.1's; typed loosely
        self, prompt_ids: Any, sampling_params: dict[str, Any], request_id: str, **kwargs: Any
    ) -> Any:
        output = await super().generate(prompt_ids, sampling_params, request_id, **kwargs)
        topk = self._sis_topk.pop(request_id, None)
        if topk is not None:
            output.extra_fields["sis_topk_ids"], output.extra_fields["sis_topk_logq"] = topk
        return output


class SISvLLMReplica(vLLMReplica):  # type: ignore[misc]
    """verl's vLLM replica launching `SISvLLMHttpServer`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(SISvLLMHttpServer)


def register_sis_vllm_rollout() -> None:
    """Rollout name `vllm` now builds `SISvLLMReplica`; call it in the process that creates the rollout
    replicas
    (verl's TaskRunner) before the trainer's `init_workers()`."""
    RolloutReplicaRegistry.register("vllm", lambda: SISvLLMReplica)


def install_sis(trainer: Any) -> None:
    """After `trainer.init_workers()`: SIS actor loss on every actor worker, top-K logits processor switched
    on.

    Works with verl's `RayPPOTrainer` (TensorDict batches) and the v1 trainer (`KVBatchMeta.extra_info`).
    """
    if trainer.config.actor_rollout_ref.model.get("use_fused_kernels", False):
        raise ValueError(
            "SIS gathers K log-probs from the logits: set actor_rollout_ref.model.use_fused_kernels=False"
        )
    actor_config = omega_conf_to_dataclass(trainer.config.actor_rollout_ref.actor)
    group = trainer.actor_rollout_wg
    group.set_loss_fn(functools.partial(sis_actor_loss, config=actor_config))
    update_actor = group.update_actor

    def update_with_topk(batch: Any, *args: Any, **kwargs: Any) -> Any:
        if hasattr(batch, "extra_info"):
            batch.extra_info["distillation_use_topk"] = True
        else:
            tu.assign_non_tensor(batch, distillation_use_topk=True)
        return update_actor(batch, *args, **kwargs)

    group.update_actor = update_with_topk


class SISRayPPOTrainer(RayPPOTrainer):  # type: ignore[misc]
    """verl's `RayPPOTrainer` with the SIS rollout server and actor loss; the training loop is verl's."""

    def init_workers(self) -> None:
        # before the agent loop manager, built inside init_workers, makes the rollout replicas
        register_sis_vllm_rollout()
        super().init_workers()
        install_sis(self)


def setup_worker() -> None:
    """Ray `worker_process_setup_hook`: registers the SIS losses and points verl's v0 TaskRunner, which builds
    its trainer by the module-level name `RayPPOTrainer`, at `SISRayPPOTrainer`. Runs once in every Ray process."""
    import sisrl.trainer.plugins.verl  # noqa: F401  (registers `sis` and `sis_gspo` with verl)
    import verl.trainer.main_ppo_v0 as task_runner_module

    task_runner_module.RayPPOTrainer = SISRayPPOTrainer  # type: ignore[misc]  # deliberate module patch
    register_sis_vllm_rollout()  # whichever process builds the rollout replicas


__all__ = [
    "SISRayPPOTrainer",
    "SISvLLMHttpServer",
    "SISvLLMReplica",
    "install_sis",
    "register_sis_vllm_rollout",
    "setup_worker",
    "sis_k",
]
