"""Run by tests/trainer/test_push.py under `torchrun --nproc-per-node 2`: the tiny policy under FSDP2 pushed as
bf16 shards of at most SHARD_BYTES into OUT/push; every rank writes its `PushStats` to OUT/stats_RANK.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from sisrl.common.models import build_tiny_policy, load_tokenizer
from sisrl.trainer.config import DistributedConfig
from sisrl.trainer.distributed import init_distributed, shutdown, wrap_model
from sisrl.trainer.push import write_push

SHARD_BYTES = 64 << 10  # 64 KiB: the 6 MiB bf16 embedding gets a shard of its own, the layers fill several

if __name__ == "__main__":
    out = Path(sys.argv[1])
    ctx = init_distributed(DistributedConfig(strategy="fsdp2"), "cpu")
    torch.set_num_threads(1)
    tokenizer = load_tokenizer()
    model = wrap_model(build_tiny_policy(tokenizer, seed=0), ctx, "fsdp2")
    stats = write_push(model, tokenizer, out / "push", dtype=torch.bfloat16, max_shard_bytes=SHARD_BYTES,
                       is_main=ctx.is_main)
    (out / f"stats_{ctx.rank}.json").write_text(json.dumps(stats.figures()))
    shutdown(ctx)
