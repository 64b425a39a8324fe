"""Metrics out: one JSON line per step (`metrics.jsonl`), TensorBoard scalars, and the per-step table row.

Keys are namespaced (`sis/accept_rate`, `time/rollout_s`); docs/trainer.md defines each with its formula and
unit. Only rank 0 creates a writer.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from sisrl.common.atomic import write_text
from sisrl.trainer.batch import Trajectory, plain

METRICS_FILE = "metrics.jsonl"

# (metric key, column header, format) of the table printed once per step.
TABLE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("step", "step", "{:>4.0f}"),
    ("reward/mean", "reward", "{:>6.3f}"),
    ("sis/accept_rate", "accept", "{:>6.3f}"),
    ("sis/D", "D", "{:>7.3f}"),
    ("sis/D_sis", "D_SIS", "{:>7.3f}"),
    ("rollout/searches_per_traj", "search", "{:>6.2f}"),
    ("loss/clipfrac", "clip", "{:>5.3f}"),
    ("time/step_s", "sec", "{:>6.1f}"),
)


def rollout_metrics(trajs: list[Trajectory], rollout_s: float) -> dict[str, float]:
    """Reward, EM per data source, lengths, searches and throughput of the trajectories a step trains on (a
    rollout batch without its errored and out-of-bound trajectories)."""
    n = max(1, len(trajs))
    out: dict[str, float] = {"reward/mean": sum(t.reward for t in trajs) / n}
    out["reward/std"] = math.sqrt(sum((t.reward - out["reward/mean"]) ** 2 for t in trajs) / n)
    by_source: dict[str, list[float]] = defaultdict(list)
    for t in trajs:
        by_source[t.data_source].append(t.reward_parts.get("em", t.reward))
    for source, ems in sorted(by_source.items()):
        out[f"reward/em/{source}"] = sum(ems) / len(ems)
    for part in ("em", "f1", "format"):
        vals = [t.reward_parts[part] for t in trajs if part in t.reward_parts]
        if vals:
            out[f"reward/{part}"] = sum(vals) / len(vals)
    policy_tokens = sum(t.policy_tokens for t in trajs)
    out["rollout/response_len"] = sum(len(t.response_ids) for t in trajs) / n
    out["rollout/policy_tokens"] = policy_tokens / n
    out["rollout/searches_per_traj"] = sum(_searches(t) for t in trajs) / n
    out["rollout/trajectories"] = float(len(trajs))
    for reason, count in Counter(t.finish_reason or "unknown" for t in trajs).items():
        out[f"rollout/finish/{reason}"] = count / n
    out["perf/rollout_tokens_per_s"] = policy_tokens / max(rollout_s, 1e-9)
    return out


LAG_BUCKETS = ("0", "1", "2+")


def _bucket(lag: int) -> str:
    return LAG_BUCKETS[min(max(lag, 0), 2)]  # as the token shares count it (np.clip in staleness_metrics)


def staleness_metrics(trajs: list[Trajectory], version: int, records: list[Any] | None, *,
                      dropped: int) -> dict[str, float]:
    """Version lag of the trained tokens and the SIS diagnostics split by lag (docs/trainer.md, "Staleness").

    lag of a policy token = `version` (the policy being updated) - the version that sampled it. `records` are
    the update's TokenRecords (trainer/update.py; single process), row = index into `trajs`. The verl names
    (`rollout_corr/...`) carry the same quantities for dashboards built on verl's rollout correction."""
    from sisrl.common.wire import SIS_ACCEPTED, SIS_OUTSIDE, SIS_REJECTED
    from sisrl.trainer.pipeline import token_versions

    lags = [version - token_versions(t) for t in trajs]
    flat = np.concatenate(lags) if lags else np.zeros(0, dtype=np.int64)
    out: dict[str, float] = {
        "staleness/lag_mean": float(flat.mean()) if len(flat) else 0.0,
        "staleness/lag_max": float(flat.max()) if len(flat) else 0.0,
        "staleness/multi_version_share": sum(len(row) > 0 and bool((row != row[0]).any()) for row in lags)
        / max(len(trajs), 1),
        "staleness/dropped": float(dropped),
    }
    buckets = np.clip(flat, 0, len(LAG_BUCKETS) - 1)  # lag 0, 1, 2 or more
    for i, bucket in enumerate(LAG_BUCKETS):
        out[f"staleness/token_share_lag{bucket}"] = float((buckets == i).mean()) if len(flat) else 0.0
    if not records:
        return out
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])  # accepted, decided, |l| sum, rej |l|
    log_q_minus_p: list[float] = []
    ratios: list[float] = []
    rejected_tokens = 0
    for rec in records:
        traj = trajs[rec.row]
        versions = (plain(traj.token_versions) if traj.token_versions is not None
                    else [traj.policy_version if m else -1 for m in plain(traj.loss_mask)])
        behaviour = plain(traj.behaviour_logprobs)
        status = rec.status.tolist()
        logp = rec.logp.tolist()
        ratio = rec.ratio.tolist()
        for t, code in enumerate(status[: len(behaviour)]):
            if code < 0:
                continue
            abs_l = abs(logp[t] - behaviour[t])
            cell = acc[_bucket(version - versions[t])]
            cell[0] += code == SIS_ACCEPTED
            cell[1] += 1
            cell[2] += abs_l
            if code in (SIS_REJECTED, SIS_OUTSIDE):
                cell[3] += abs_l
                rejected_tokens += 1
            log_q_minus_p.append(behaviour[t] - logp[t])
            ratios.append(ratio[t])
    for bucket, (accepted, decided, abs_sum, rej_sum) in acc.items():
        out[f"staleness/accept_rate_lag{bucket}"] = accepted / decided
        out[f"staleness/D_per_token_lag{bucket}"] = abs_sum / decided
        out[f"staleness/D_sis_per_token_lag{bucket}"] = rej_sum / decided
    if log_q_minus_p:
        n = len(log_q_minus_p)
        out["rollout_corr/kl"] = sum(log_q_minus_p) / n  # KL(q || pi), k1 estimate from q's samples
        out["rollout_corr/k3_kl"] = sum(math.exp(-d) - 1.0 + d for d in log_q_minus_p) / n
        out["rollout_corr/rollout_is_mean"] = sum(ratios) / n
        out["rollout_corr/rollout_rs_masked_fraction"] = rejected_tokens / n  # SIS: rejected + outside V_K
    return out


def _searches(t: Trajectory) -> int:
    return sum(1 for turn in t.turns if isinstance(turn, dict) and turn.get("query"))


class MetricsWriter:
    """Appends steps to RUN_DIR/metrics.jsonl (and TensorBoard). On resume, lines past `start_step` are dropped."""

    def __init__(self, run_dir: Path, *, tensorboard: bool, start_step: int = 0) -> None:
        self.path = run_dir / METRICS_FILE
        run_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self._truncate_after(start_step)
        self.tb: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def _truncate_after(self, step: int) -> None:
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        write_text(self.path, "".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time": time.time(), **{k: _finite(v) for k, v in sorted(metrics.items())}}
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for key, value in metrics.items():
                if math.isfinite(value):
                    self.tb.add_scalar(key, value, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no NaN/inf; None marks a non-finite value


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def table_header() -> str:
    return " ".join(f"{name:>{len(fmt.format(0.0))}}" for _, name, fmt in TABLE_COLUMNS)


def table_row(step: int, metrics: dict[str, float]) -> str:
    values = {"step": float(step), **metrics}
    cells = []
    for key, _, fmt in TABLE_COLUMNS:
        value = values.get(key)
        width = len(fmt.format(0.0))
        cells.append(fmt.format(value) if value is not None and math.isfinite(value) else "-".rjust(width))
    return " ".join(cells)
