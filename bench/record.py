"""One JSON record per bench run under `bench/results/<bench>/`, from which bench/render_results.py renders
docs/results.md and the README's headline table (no figure is written by hand anywhere else).

Every bench calls `write_record` once at the end of a run with its figures and the baseline measured in the same
run; this module adds what makes a figure comparable: the commit (and whether the tree was dirty), the UTC date,
and the machine (CPU model, family/model, cores, the SIMD flags that decide sisrl's kernels and dtypes, and the
machine `kind` derived from them). A run through bench/as_avx2.sh sees a /proc/cpuinfo without AVX-512/AMX flags
and torch capped at AVX2; it is recorded as kind `x86-avx2` with `emulated_on` naming the real machine (the
script exports SISRL_AS_AVX2_REAL_CPU and SISRL_AS_AVX2_REAL_FLAGS for this), so it lands in the AVX2 column
with the real CPU beside it.

Record schema (every key present; `schema` 1):
  bench      str, [a-z][a-z0-9_]*: the results folder, e.g. "retriever"
  title      str: the section title in docs/results.md
  measures   str: what the bench measures, in a sentence or two
  summary    str: one sentence, what this run shows
  command    str | null: the command line that was run (null: an imported log that does not give it)
  figures    {name: number | str | bool | null | [number | str ...]}: this run's figures (names carry units)
  baseline   null | {"what": str, "figures": {...}}: the baseline measured in the same run; a figure of the same
             name in both gets a ratio in docs/results.md
  table      null | {"columns": [str], "rows": [[cell]]}: the run's table, when it has one
  headline   null | {"row": str, "value": str, "rank": int}: a row of the README's results table
  commit     {"sha": str | null, "dirty": bool | null}
  date       str | null: UTC, "YYYY-MM-DDTHH:MM:SSZ" (or "YYYY-MM-DD" where only the day is known)
  machine    {"kind": str, "cpu": str | null, "family": int | null, "model": int | null, "cores": int | null,
              "flags": [str] | null, "isa_caps": {env var: value}, "emulated_on": null | {"kind", "cpu", "flags"}}
  source     null for a run recorded by its bench; else where the figures come from (an imported log)
  notes      str | null: what a reader needs besides the figures (load, cache state, caveats)

    from record import write_record   # bench/ is on sys.path when a bench runs as `python bench/x.py`
    write_record(bench="sis_overhead", title=..., measures=..., summary=..., figures={...},
                 baseline={"what": "plain IS ratio, same process", "figures": {...}})
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sisrl.common.hardware import cpu_fields

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SCHEMA = 1
KEYS = ("schema", "bench", "title", "measures", "summary", "command", "figures", "baseline", "table", "headline",
        "commit", "date", "machine", "source", "notes")
# The /proc/cpuinfo flags that decide which kernels and dtypes sisrl and its libraries use.
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
              "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
# Set by bench/as_avx2.sh: torch's, oneDNN's and MKL's instruction-set caps.
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
KINDS = {
    "x86-avx2": "AVX2 only: fp32 kernels, no native bf16",
    "x86-avx512": "AVX-512 without bf16 instructions: fp32",
    "x86-avx512-bf16": "AVX-512 with avx512_bf16: native bf16 dot products",
    "x86-amx": "AMX tiles (amx_bf16): native bf16 matrix units",
}
_NAME = re.compile(r"[a-z][a-z0-9_]*")
_KIND = re.compile(r"[a-z0-9][a-z0-9_-]*")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}:\d{2}Z)?")
Scalar = int | float | str | bool | None


def machine_kind(flags: Iterable[str], arch: str = "x86_64") -> str:
    """`x86-amx` (amx_bf16), `x86-avx512-bf16` (avx512_bf16), `x86-avx512` (avx512f), `x86-avx2` (avx2), else
    `x86` or the architecture's own name (`aarch64`): the kinds whose figures are comparable with each other."""
    if arch not in ("x86_64", "AMD64", "amd64", "i386", "i686"):
        return arch.lower() or "unknown"
    have = set(flags)
    for flag, kind in (("amx_bf16", "x86-amx"), ("avx512_bf16", "x86-avx512-bf16"), ("avx512f", "x86-avx512"),
                       ("avx2", "x86-avx2")):
        if flag in have:
            return kind
    return "x86"


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.strip().isdigit() else None


def machine_info(cpuinfo: Path = Path("/proc/cpuinfo"), env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """This machine as the record's `machine`: CPU model, family/model, usable cores, SIMD flags, kind, the ISA
    caps in the environment, and `emulated_on` when bench/as_avx2.sh hid the real flags (its env vars)."""
    env = os.environ if env is None else env
    fields = cpu_fields(cpuinfo)
    flags = set(fields.get("flags", fields.get("Features", "")).split())
    arch = platform.machine()
    info: dict[str, Any] = {
        "kind": machine_kind(flags, arch), "cpu": fields.get("model name") or None,
        "family": _int(fields.get("cpu family")), "model": _int(fields.get("model")),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "flags": sorted(flags & set(SIMD_FLAGS)),
        "isa_caps": {name: env[name] for name in ISA_CAPS if env.get(name)},
        "emulated_on": None,
    }
    real_flags = env.get("SISRL_AS_AVX2_REAL_FLAGS")
    if real_flags is not None:
        real = set(real_flags.split())
        info["kind"] = "x86-avx2"
        info["emulated_on"] = {"kind": machine_kind(real | {"avx2"}, arch),
                               "cpu": env.get("SISRL_AS_AVX2_REAL_CPU") or None,
                               "flags": sorted(real & set(SIMD_FLAGS))}
    return info


def git_commit(root: Path = ROOT) -> dict[str, Any]:
    """{"sha": short HEAD, "dirty": tracked files changed}; nulls where git cannot tell (no git, no repo)."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    sha = git("rev-parse", "--short", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha.strip() if sha else None, "dirty": None if status is None else bool(status.strip())}


def command_line(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> str:
    """The command as run: the interpreter and script relative to the clone where they lie in it, the arguments,
    and `bench/as_avx2.sh` in front when it ran the command."""
    env = os.environ if env is None else env
    argv = list(sys.argv if argv is None else argv)

    def short(path: str) -> str:  # not resolved: a venv's python is a link to the system's
        absolute = Path(os.path.abspath(path))
        return absolute.relative_to(ROOT).as_posix() if absolute.is_relative_to(ROOT) else path

    words = [short(sys.executable), short(argv[0]), *argv[1:]] if argv and argv[0].endswith(".py") else argv
    prefix = ["bench/as_avx2.sh"] if "SISRL_AS_AVX2_REAL_FLAGS" in env else []
    return shlex.join(prefix + words)


def _clean(value: Any) -> Any:
    """JSON has no NaN or infinity: such floats become null (a figure that could not be measured)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


def build_record(*, bench: str, title: str, measures: str, summary: str, figures: Mapping[str, Any],
                 baseline: Mapping[str, Any] | None, command: str | None = None,
                 table: Mapping[str, Any] | None = None, headline: Mapping[str, Any] | None = None,
                 notes: str | None = None, source: str | None = None, date: str | None = None,
                 commit: Mapping[str, Any] | None = None, machine: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A validated record; what is not given (command, date, commit, machine) is read from this process and
    machine. ValueError names the first bad field and value."""
    record = {
        "schema": SCHEMA, "bench": bench, "title": title, "measures": measures, "summary": summary,
        "command": command_line() if command is None else command,
        "figures": _clean(dict(figures)), "baseline": _clean(dict(baseline)) if baseline is not None else None,
        "table": _clean(dict(table)) if table is not None else None,
        "headline": dict(headline) if headline is not None else None,
        "commit": dict(commit) if commit is not None else git_commit(),
        "date": date if date is not None else datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": dict(machine) if machine is not None else machine_info(),
        "source": source, "notes": notes,
    }
    validate_record(record)
    return record


def write_record(*, bench: str, title: str, measures: str, summary: str, figures: Mapping[str, Any],
                 baseline: Mapping[str, Any] | None, command: str | None = None,
                 table: Mapping[str, Any] | None = None, headline: Mapping[str, Any] | None = None,
                 notes: str | None = None, results_dir: Path | None = None) -> Path:
    """Build this run's record (see the module docstring) and write it under `results_dir/<bench>/`
    (default: `$SISRL_BENCH_RESULTS`, else bench/results); returns the file. Prints where it went."""
    record = build_record(bench=bench, title=title, measures=measures, summary=summary, figures=figures,
                          baseline=baseline, command=command, table=table, headline=headline, notes=notes)
    path = save_record(record, results_dir)
    print(f"record: {path}")
    return path


def record_name(record: Mapping[str, Any]) -> str:
    """`<UTC date-time>-<kind>-<commit>`, e.g. `20261204T211300Z-x86-avx2-5b69e1e` (`undated`, `nocommit`
    where the record has none)."""
    date = record["date"]
    stamp = date.replace("-", "").replace(":", "") if date else "undated"
    return f"{stamp}-{record['machine']['kind']}-{record['commit']['sha'] or 'nocommit'}"


def save_record(record: Mapping[str, Any], results_dir: Path | None = None) -> Path:
    """Validate and write `record` as `<results_dir>/<bench>/<record_name>.json` (a `-2`, `-3`... suffix where
    that name is taken), sorted keys, indent 2, via a temp file + rename."""
    validate_record(record)
    root = results_dir or Path(os.environ.get("SISRL_BENCH_RESULTS") or RESULTS)
    folder = root / record["bench"]
    folder.mkdir(parents=True, exist_ok=True)
    base = record_name(record)
    path, n = folder / f"{base}.json", 1
    while path.exists():
        n += 1
        path = folder / f"{base}-{n}.json"
    tmp = folder / f".{path.name}.tmp"
    tmp.write_text(json.dumps(record, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n",
                   encoding="utf-8")
    os.replace(tmp, path)
    return path


def load_record(path: Path) -> dict[str, Any]:
    """Read and validate one record; ValueError naming the file and the problem."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        validate_record(record)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    if path.parent.name != record["bench"]:
        raise ValueError(f"{path}: bench {record['bench']!r} lies in folder {path.parent.name!r}")
    return dict(record)


def _need(ok: bool, field: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"{field}: expected {expected}, got {value!r}")


def _text(value: Any, field: str, *, nullable: bool = False) -> None:
    if nullable and value is None:
        return
    _need(isinstance(value, str) and bool(value.strip()), field, value, "a non-empty string")


def _opt_int(value: Any, field: str) -> None:
    _need(value is None or (isinstance(value, int) and not isinstance(value, bool)), field, value, "an int or null")


def _figures(value: Any, field: str) -> None:
    _need(isinstance(value, dict) and bool(value), field, value, "a non-empty {name: value} object")
    for name, v in value.items():
        _text(name, f"{field} name")
        items = v if isinstance(v, list) else [v]
        for item in items:
            ok = item is None or isinstance(item, int | str | bool) or (isinstance(item, float) and math.isfinite(item))
            _need(ok, f"{field}[{name!r}]", v, "a number, string, bool or null (or a list of them; no NaN)")


def _machine(value: Any) -> None:
    _need(isinstance(value, dict), "machine", value, "an object")
    _need(isinstance(value.get("kind"), str) and bool(_KIND.fullmatch(value["kind"])), "machine.kind",
          value.get("kind"), "a kind such as x86-avx2 ([a-z0-9_-]+)")
    _text(value.get("cpu"), "machine.cpu", nullable=True)
    for key in ("family", "model", "cores"):
        _opt_int(value.get(key), f"machine.{key}")
    flags = value.get("flags")
    _need(flags is None or (isinstance(flags, list) and all(isinstance(f, str) for f in flags)), "machine.flags",
          flags, "a list of flag names or null")
    caps = value.get("isa_caps", {})
    _need(isinstance(caps, dict) and all(isinstance(v, str) for v in caps.values()), "machine.isa_caps", caps,
          "an {env var: value} object")
    emulated = value.get("emulated_on")
    if emulated is not None:
        _need(isinstance(emulated, dict), "machine.emulated_on", emulated, "null or an object")
        _need(isinstance(emulated.get("kind"), str) and bool(_KIND.fullmatch(emulated["kind"])),
              "machine.emulated_on.kind", emulated.get("kind"), "a machine kind")
        _text(emulated.get("cpu"), "machine.emulated_on.cpu", nullable=True)


def validate_record(record: Any) -> None:
    """ValueError naming the first missing key, or the field and value of the wrong type (schema: module doc)."""
    _need(isinstance(record, dict), "record", type(record).__name__, "a JSON object")
    missing = [k for k in KEYS if k not in record]
    _need(not missing, "record", sorted(record), f"every key of {list(KEYS)} (missing {missing})")
    _need(record["schema"] == SCHEMA, "schema", record["schema"], f"{SCHEMA}")
    _need(isinstance(record["bench"], str) and bool(_NAME.fullmatch(record["bench"])), "bench", record["bench"],
          "a name of [a-z][a-z0-9_]*")
    for key in ("title", "measures", "summary"):
        _text(record[key], key)
    _text(record["command"], "command", nullable=True)
    _need("\n" not in record["summary"], "summary", record["summary"], "one sentence on one line")
    _figures(record["figures"], "figures")
    baseline = record["baseline"]
    if baseline is not None:
        _need(isinstance(baseline, dict), "baseline", baseline, "null or {what, figures}")
        _text(baseline.get("what"), "baseline.what")
        _figures(baseline.get("figures"), "baseline.figures")
    table = record["table"]
    if table is not None:
        _need(isinstance(table, dict) and isinstance(table.get("columns"), list) and bool(table["columns"]),
              "table", table, "null or {columns: [str], rows: [[cell]]}")
        _need(isinstance(table.get("rows"), list), "table.rows", table.get("rows"), "a list of rows")
        for row in table["rows"]:
            _need(isinstance(row, list) and len(row) == len(table["columns"]), "table row", row,
                  f"a list of {len(table['columns'])} cells")
        _figures({str(i): row for i, row in enumerate(table["rows"])} or {"-": None}, "table.rows")
    headline = record["headline"]
    if headline is not None:
        _need(isinstance(headline, dict), "headline", headline, "null or {row, value, rank}")
        _text(headline.get("row"), "headline.row")
        _text(headline.get("value"), "headline.value")
        rank = headline.get("rank")
        _need(isinstance(rank, int) and not isinstance(rank, bool) and 1 <= rank <= 99, "headline.rank", rank,
              "an int in 1..99")
    commit = record["commit"]
    _need(isinstance(commit, dict), "commit", commit, "{sha, dirty}")
    _text(commit.get("sha"), "commit.sha", nullable=True)
    _need(commit.get("dirty") is None or isinstance(commit.get("dirty"), bool), "commit.dirty", commit.get("dirty"),
          "a bool or null")
    date = record["date"]
    _need(date is None or (isinstance(date, str) and bool(_DATE.fullmatch(date))), "date", date,
          "null, YYYY-MM-DD or YYYY-MM-DDTHH:MM:SSZ (UTC)")
    _machine(record["machine"])
    _text(record["source"], "source", nullable=True)
    _text(record["notes"], "notes", nullable=True)
