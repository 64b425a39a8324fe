"""Run by tests/trainer/test_distributed.py under `torchrun --nproc-per-node 2`: the compact log-prob path of a
tiny FSDP2 policy (and of its sharded reference) on one batch that every rank holds whole.

    torchrun --nproc-per-node 2 tests/trainer/fsdp_logits_worker.py BATCH.json OUT_DIR
rank 0 writes OUT_DIR/{full,shared}.safetensors (log-probs at the policy tokens, gathered gradients) and
OUT_DIR/shapes.json (what the lm_head was given and returned; the reference's parameter layout per rank).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from sisrl.trainer.batch import RolloutBatch, Trajectory, collate
from sisrl.trainer.config import DistributedConfig, ModelConfig
from sisrl.trainer.distributed import init_distributed, shutdown, wrap_model, wrap_reference
from sisrl.trainer.policy import load_policy, policy_logits
from sisrl.trainer.sis import gather_logprobs
from transformers import PreTrainedModel


def logp_and_grads(model: PreTrainedModel, batch: RolloutBatch, shared: bool, shapes: list[list[list[int]]]
                   ) -> dict[str, torch.Tensor]:
    """Log-probs of the policy tokens and the gradient of their negated sum, every [.., V] step in between the
    trainer's own; `shapes` receives [input, output] of each lm_head call."""
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda _m, args, out: shapes.append([list(args[0].shape), list(out.shape)]))
    logits, view = policy_logits(model, batch, compact=True, shared_prefix=shared)
    hook.remove()
    logp = gather_logprobs(logits, view.response_ids)
    (-(logp * view.mask).sum()).backward()
    out = {"logp": logp[view.mask > 0].detach()}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # a collective on every rank
        out[f"grad.{name}"] = grad.detach().clone().contiguous()
    return out


if __name__ == "__main__":
    batch_path, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    ctx = init_distributed(DistributedConfig(strategy="fsdp2"), "cpu")
    torch.set_num_threads(1)
    batch = collate([Trajectory.from_json(o) for o in json.loads(batch_path.read_text())], pad_id=0, k=1)
    report: dict[str, object] = {}
    for shared in (False, True):
        model, _ = load_policy(ModelConfig(path="tiny"), seed=0, device=ctx.device)
        ref = copy.deepcopy(model).eval().requires_grad_(False)
        wrap_model(model, ctx, "fsdp2")  # in place
        shapes: list[list[list[int]]] = []
        result = logp_and_grads(model, batch, shared, shapes)
        name = "shared" if shared else "full"
        report[f"{name}_head"] = shapes
        if ctx.rank == 0:
            save_file(result, str(out_dir / f"{name}.safetensors"))
    ref = wrap_reference(ref, ctx, "fsdp2")
    local = sum(p.to_local().numel() * p.element_size() for p in ref.parameters())  # type: ignore[operator]
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    sharded = all(hasattr(p, "to_local") for p in ref.parameters())
    with torch.no_grad():
        ref_logits, view = policy_logits(ref, batch, compact=True)
    sizes = [torch.zeros(2, dtype=torch.float64) for _ in range(ctx.world)]
    dist.all_gather(sizes, torch.tensor([local, total], dtype=torch.float64))
    report["ref"] = {"dtensor": sharded, "resharded_after_forward": all(hasattr(p, "to_local") for p in ref.parameters()),
                     "requires_grad": any(p.requires_grad for p in ref.parameters()), "training": ref.training,
                     "local_bytes": [float(s[0]) for s in sizes], "total_bytes": float(sizes[0][1])}
    if ctx.rank == 0:
        save_file({"logp": gather_logprobs(ref_logits, view.response_ids)[view.mask > 0].contiguous()},
                  str(out_dir / "ref.safetensors"))
        (out_dir / "shapes.json").write_text(json.dumps(report))
    shutdown(ctx)
