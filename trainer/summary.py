"""The demo's result: `runs/demo/summary.json` (schema below), the same numbers as a table, and a reward/EM plot.

Schema (keys exactly these; more are allowed):
  {"eval": {"before" | "after_sft" | "after_rl": {"em": float, "em_by_source": {source: float},
                                                  "searches_per_traj": float}},
   "train_reward": [mean reward per RL step], "steps": int, "checkpoint": str, "wall_s": float}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

STAGES = ("before", "after_sft", "after_rl")


class StageEval(BaseModel):
    model_config = ConfigDict(extra="allow")

    em: float = Field(ge=0, le=1, description="exact match over the test split")
    em_by_source: dict[str, float] = Field(description="EM per data source (nq: one hop, hotpotqa: two hops)")
    searches_per_traj: float = Field(ge=0, description="mean <search> calls per trajectory")


class DemoSummary(BaseModel):
    model_config = ConfigDict(extra="allow")

    eval: dict[str, StageEval] = Field(description="one entry per stage: before, after_sft, after_rl")
    train_reward: list[float] = Field(description="mean reward of each RL step's rollout batch")
    steps: int = Field(ge=0, description="RL steps trained")
    checkpoint: str = Field(description="the final RL checkpoint")
    wall_s: float = Field(ge=0, description="seconds from start to summary")

    def model_post_init(self, _context: Any) -> None:
        missing = [s for s in STAGES if s not in self.eval]
        if missing:
            raise ValueError(f"eval lacks stage(s) {missing}; expected {list(STAGES)}")


def stage_eval(metrics: dict[str, float]) -> StageEval:
    """The `eval/...` metrics of `trainer.evaluate.evaluate` as one summary stage."""
    by_source = {k.removeprefix("eval/em/"): v for k, v in metrics.items() if k.startswith("eval/em/")}
    return StageEval(em=metrics["eval/em"], em_by_source=by_source,
                     searches_per_traj=metrics["eval/searches_per_traj"])


def write_summary(path: Path, summary: DemoSummary) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(summary.model_dump_json(indent=1) + "\n")
    tmp.replace(path)
    return path


def read_summary(path: Path) -> DemoSummary:
    """Parse and validate a summary file; ValueError naming the file and the problem."""
    try:
        return DemoSummary.model_validate(json.loads(path.read_text()))
    except ValueError as err:
        raise ValueError(f"{path}: not a demo summary ({err})") from None


def summary_table(summary: DemoSummary) -> str:
    """Stages as rows: EM overall and per source, searches per trajectory; then the reward curve."""
    sources = sorted({s for stage in summary.eval.values() for s in stage.em_by_source})
    header = f"{'stage':10s} {'EM':>6s} " + " ".join(f"{'EM ' + s:>12s}" for s in sources) + f" {'searches':>9s}"
    lines = [header]
    for name in STAGES:
        st = summary.eval[name]
        cells = " ".join(f"{st.em_by_source.get(s, float('nan')):>12.3f}" for s in sources)
        lines.append(f"{name:10s} {st.em:>6.3f} {cells} {st.searches_per_traj:>9.2f}")
    rewards = " ".join(f"{r:.2f}" for r in summary.train_reward)
    lines.append(f"train reward per RL step ({summary.steps} steps): {rewards}")
    lines.append(f"checkpoint: {summary.checkpoint}   wall time: {summary.wall_s:.0f}s")
    extra = summary.model_extra or {}
    if "cpu" in extra:
        lines.append(f"CPU: {extra['cpu']}; rollout engine {extra.get('engine_dtype', '?')}, "
                     f"trainer {extra.get('trainer_dtype', '?')}")
    return "\n".join(lines)


def plot_summary(summary: DemoSummary, out: Path) -> Path:
    """Train reward per RL step, with the test EM of each stage as horizontal marks (PNG, temp + rename)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    steps = list(range(1, len(summary.train_reward) + 1))
    ax.plot(steps, summary.train_reward, marker="o", label="train reward (RL rollouts)")
    for name, style in zip(STAGES, (":", "--", "-"), strict=True):
        ax.axhline(summary.eval[name].em, linestyle=style, color="gray", label=f"test EM {name}")
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out)
    return out
