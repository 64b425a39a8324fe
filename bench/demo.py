"""The CPU demo as a bench: runs `python -m sisrl.trainer.demo` (every option passed through), times it end to end
and records test EM before training, after SFT and after RL (overall and per source), searches per trajectory,
the train reward curve, the wall time and the dtypes, read from the summary the demo writes
(`<workdir>/summary.json`, trainer/summary.py). The baseline of the same run is the untrained policy's eval.

    .venv/bin/python bench/demo.py                                   # the demo as `make demo` runs it
    SISRL_CACHE=$(mktemp -d) .venv/bin/python bench/demo.py --workdir /tmp/demo   # from an empty user cache
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from record import write_record
from sisrl.common.cache import user_cache_dir
from sisrl.trainer.summary import read_summary


def stage(summary: Any, name: str, label: str = "") -> dict[str, Any]:
    """One eval stage as figures: EM overall and per source, searches per trajectory."""
    st = summary.eval[name]
    return {f"test EM{label}": round(st.em, 4),
            **{f"test EM{label}: {src}": round(v, 4) for src, v in sorted(st.em_by_source.items())},
            f"searches per trajectory{label}": round(st.searches_per_traj, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     add_help=False)
    parser.add_argument("--workdir", type=Path, default=Path("runs/demo"), help="the demo's --workdir")
    parser.add_argument("-h", "--help", action="store_true", help="this help, then the demo's own")
    args, _ = parser.parse_known_args()
    passed = [a for a in sys.argv[1:] if a not in ("-h", "--help")]
    command = [sys.executable, "-m", "sisrl.trainer.demo", *passed]
    if args.help:
        parser.print_help()
        print()
        return subprocess.run([*command, "--help"], check=False).returncode
    cache = user_cache_dir()
    warm = any(cache.iterdir())
    started = time.perf_counter()
    done = subprocess.run(command, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        print(f"bench/demo.py: the demo exited with {done.returncode}; no record written", file=sys.stderr)
        return done.returncode
    summary = read_summary(args.workdir / "summary.json")
    extra = summary.model_extra or {}
    before, sft, rl = (summary.eval[s].em for s in ("before", "after_sft", "after_rl"))
    state = "warm" if warm else "empty"
    write_record(
        bench="demo", title="The CPU demo (`make demo`)",
        measures="`python -m sisrl.trainer.demo` end to end: a fictional world whose answers need searching, its "
                 "E5 index, the retriever and gateway as real processes, SFT of SmolLM2-135M-Instruct on teacher "
                 "demonstrations, then GRPO + SIS; test EM (greedy) before training, after SFT and after RL, and "
                 "the wall time (target: <= 15 minutes on 2 CPU cores).",
        summary=f"Test EM went {before:.3f} -> {sft:.3f} (SFT) -> {rl:.3f} (RL) in {wall:.0f} s from a {state} "
                "user cache.",
        figures={**stage(summary, "after_rl"), **stage(summary, "after_sft", " after SFT"), "wall s": round(wall, 1),
                 "summary wall_s": round(summary.wall_s, 1), "RL steps": summary.steps,
                 "train reward": [round(r, 3) for r in summary.train_reward], "user cache at start": state,
                 "engine dtype": extra.get("engine_dtype"), "trainer dtype": extra.get("trainer_dtype")},
        baseline={"what": "the untrained policy (stage `before`), same run", "figures": stage(summary, "before")},
        notes=f"demo command: python -m sisrl.trainer.demo {' '.join(passed)}".rstrip(),
        headline={"row": "Demo: test EM before / after SFT / after RL; wall time (target <= 15 min)", "rank": 1,
                  "value": f"{before:.3f} / {sft:.3f} / **{rl:.3f}**; {wall:.0f} s ({state} cache)"}
        if not any(a.startswith(("--set", "--config")) for a in passed) else None)  # the demo as shipped only
    return 0


if __name__ == "__main__":
    sys.exit(main())
