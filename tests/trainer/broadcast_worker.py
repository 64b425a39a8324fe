"""One rank of the batch broadcast (used by test_arrow_batch.py): rank 0 takes a batch from a source that reads
BATCH.json, `loop._rollouts` sends it to every rank as Arrow IPC bytes over gloo, each rank writes what it got.

    torchrun --nproc-per-node 2 tests/trainer/broadcast_worker.py BATCH.json OUT_DIR
writes OUT_DIR/rank{r}.json (the trajectories as `Trajectory.to_json` gives them)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from sisrl.trainer.batch import Trajectory
from sisrl.trainer.config import DistributedConfig
from sisrl.trainer.distributed import init_distributed, shutdown
from sisrl.trainer.loop import _rollouts


class FileSource:
    needs_weights = False

    def __init__(self, path: Path) -> None:
        self.path = path

    def rollouts(self, items: list[Any], step: int, version: int) -> list[Trajectory]:
        return [Trajectory.from_json(t) for t in json.loads(self.path.read_text())]


def main() -> None:
    batch, out = Path(sys.argv[1]), Path(sys.argv[2])
    ctx = init_distributed(DistributedConfig(strategy="ddp", backend="gloo"), "cpu")
    session = SimpleNamespace(pipeline=None, pusher=None, sampler=None, step=0, version=0,
                              source=FileSource(batch) if ctx.is_main else None)
    taken = _rollouts(ctx, session, SimpleNamespace())  # type: ignore[arg-type]
    (out / f"rank{ctx.rank}.json").write_text(json.dumps([t.to_json() for t in taken.trajectories]))
    shutdown(ctx)


if __name__ == "__main__":
    main()
