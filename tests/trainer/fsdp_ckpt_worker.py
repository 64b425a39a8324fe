"""Run by tests/trainer/test_distributed.py under `torchrun --nproc-per-node 2`: an FSDP2 model whose vocabulary
does not divide by the ranks (rows shard unevenly), one AdamW step, a checkpoint, a fresh model and optimizer
restored from it, then one more step on both: rank 0 writes the largest difference to OUT/diff.txt."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from sisrl.trainer.checkpoint import read_latest, restore, save_checkpoint
from sisrl.trainer.config import config_from_dict
from sisrl.trainer.distributed import barrier, init_distributed, shutdown, wrap_model
from sisrl.trainer.policy import build_scheduler
from transformers import Qwen2Config, Qwen2ForCausalLM

VOCAB = 1001  # odd: FSDP2 gives rank 0 501 rows of the (tied) embedding and rank 1 500


def build(ctx: object, cfg: object) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    model = wrap_model(model, ctx, "fsdp2")  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, build_scheduler(optimizer, cfg.optim, 10)  # type: ignore[attr-defined]


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().detach().clone() for k, v in model.named_parameters()}  # type: ignore[operator]


if __name__ == "__main__":
    out = Path(sys.argv[1])
    cfg = config_from_dict({"rollout": {"source": "synthetic"}, "model": {"path": "tiny"}, "device": "cpu",
                            "distributed": {"strategy": "fsdp2"}})
    ctx = init_distributed(cfg.distributed, "cpu")
    torch.set_num_threads(1)
    model, optimizer, scheduler = build(ctx, cfg)
    step(model, optimizer, 1)
    generator = torch.Generator().manual_seed(0)
    save_checkpoint(out / "run", step=1, policy_version=1, model=model, optimizer=optimizer, scheduler=scheduler,
                    generator=generator, sampler={}, config=cfg.model_dump(mode="json"), rank=ctx.rank,
                    world=ctx.world, barrier=lambda: barrier(ctx))
    step(model, optimizer, 2)
    again, optimizer2, scheduler2 = build(ctx, cfg)
    ckpt = read_latest(out / "run", rank=ctx.rank, world=ctx.world)
    assert ckpt is not None
    restore(ckpt, model=again, optimizer=optimizer2, scheduler=scheduler2, generator=torch.Generator())
    step(again, optimizer2, 2)
    a, b = full(model), full(again)
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    if ctx.rank == 0:
        (out / "diff.txt").write_text(f"{diff}\n")
    shutdown(ctx)
