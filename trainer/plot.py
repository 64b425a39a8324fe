"""`sisrl-train plot RUN_DIR`: one PNG per metric namespace (reward, sis, actor, loss, rollout, perf, time, ...)
with a panel per metric against the training step, from RUN_DIR/metrics.jsonl."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from sisrl.common.atomic import atomic_path
from sisrl.trainer.metrics import read_metrics


def series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metric key -> [(step, value)] for every finite numeric value."""
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for row in read_metrics(run_dir):
        for key, value in row.items():
            if key in ("step", "time") or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            out[key].append((int(row["step"]), float(value)))
    return dict(out)


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write the PNGs (temp file + rename) and return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = series(run_dir)
    if not data:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} holds no metrics to plot")
    out_dir = out_dir or run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    groups: dict[str, list[str]] = defaultdict(list)
    for key in sorted(data):
        groups[key.split("/", 1)[0] if "/" in key else "misc"].append(key)
    written = []
    for name, keys in sorted(groups.items()):
        cols = min(3, len(keys))
        rows = math.ceil(len(keys) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows), squeeze=False)
        for ax, key in zip(axes.flat, keys, strict=False):
            steps, values = zip(*data[key], strict=True)
            ax.plot(steps, values, marker="o", markersize=3)
            ax.set_title(key, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(keys):]:
            ax.axis("off")
        fig.tight_layout()
        target = out_dir / f"{name}.png"
        with atomic_path(target) as tmp:
            fig.savefig(tmp, dpi=90, format="png")
        plt.close(fig)
        written.append(target)
    return written
