"""Results are data: every bench record under bench/results/ is valid, and docs/results.md and the README's
results block are what bench/render_results.py renders from them (no figure written by hand)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RENDER = ".venv/bin/python bench/render_results.py"


@pytest.fixture(scope="module")
def mods() -> tuple[ModuleType, ModuleType]:
    """bench/record.py and bench/render_results.py, imported as the benches import them (bench/ on the path)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module("record"), importlib.import_module("render_results")
    finally:
        sys.path.remove(str(BENCH))


FIELDS: dict = {"bench": "toy", "title": "A toy bench", "measures": "How fast a toy runs.",
                "summary": "The toy ran twice as fast as its baseline.", "command": "python bench/toy.py",
                "figures": {"runs/s": 2.0, "passed": 3},
                "baseline": {"what": "the slow way, same run", "figures": {"runs/s": 1.0}},
                "headline": {"row": "toy speed", "value": "**2.00x**", "rank": 1}}


def _record(record: ModuleType, **changes: object) -> dict:
    return dict(record.build_record(**{**FIELDS, **changes}))


def test_the_committed_results_page_and_readme_block_are_current(mods: tuple[ModuleType, ModuleType]) -> None:
    _, render = mods
    problems = render.check()
    assert problems == [], "\n".join(problems) + f"\nrun: {RENDER}"


def test_every_record_has_the_required_keys_and_types(mods: tuple[ModuleType, ModuleType]) -> None:
    record, _ = mods
    paths = sorted((BENCH / "results").glob("*/*.json"))
    assert len(paths) >= 15, f"expected the imported and measured records under bench/results/, found {len(paths)}"
    for path in paths:
        data = record.load_record(path)  # ValueError names the file and the field
        assert set(data) == set(record.KEYS), f"{path}: keys {sorted(data)}"
        assert path.read_text(encoding="utf-8") == json.dumps(data, sort_keys=True, indent=2,
                                                              ensure_ascii=False) + "\n", f"{path}: not as written"
        assert path.stem.startswith(record.record_name(data)), f"{path}: name does not match its date/kind/commit"


def test_a_written_record_renders_and_a_stale_page_is_caught(mods: tuple[ModuleType, ModuleType],
                                                              tmp_path: Path) -> None:
    record, render = mods
    results, docs, readme = tmp_path / "results", tmp_path / "docs" / "results.md", tmp_path / "README.md"
    readme.write_text(f"# toy\n\nintro\n\n{render.BEGIN}\nold table\n{render.END}\n\nrest\n", encoding="utf-8")
    first = record.write_record(results_dir=results, **FIELDS)
    assert first.parent == results / "toy" and first.suffix == ".json"
    assert render.check(results, docs, readme) != []  # nothing rendered yet
    render.render(results, docs, readme)
    assert render.check(results, docs, readme) == []
    page = docs.read_text(encoding="utf-8")
    assert "The toy ran twice as fast as its baseline." in page
    assert "| runs/s | 2 | 1 | 2x |" in page  # this run, the same run's baseline, the ratio
    text = readme.read_text(encoding="utf-8")
    assert text.startswith("# toy\n\nintro\n\n") and text.endswith("\n\nrest\n") and "old table" not in text
    assert f"[**2.00x**](docs/results.md#toy-{json.loads(first.read_text())['machine']['kind']})" in text
    render.render(results, docs, readme)
    assert docs.read_text(encoding="utf-8") == page  # deterministic: the same records, the same bytes
    # a second run of the bench: the page and the README block are stale until rendered again
    second = record.save_record(_record(record, summary="The toy ran three times as fast.", date="2099-01-01"),
                                results)
    problems = render.check(results, docs, readme)
    assert any(str(docs) in p for p in problems) and any(str(readme) in p for p in problems), problems
    assert render.main(["--check", "--results", str(results), "--docs", str(docs), "--readme", str(readme)]) == 1
    render.render(results, docs, readme)
    page = docs.read_text(encoding="utf-8")
    assert "The toy ran three times as fast." in page  # the latest record of the kind is shown
    assert f"]({Path('../results/toy') / first.name})" in page  # the first is linked as an older record
    assert second.name not in page.split("Older records:")[-1]


def test_a_guide_block_shows_the_latest_table_and_goes_stale(mods: tuple[ModuleType, ModuleType],
                                                            tmp_path: Path) -> None:
    record, render = mods
    results, docs, readme = tmp_path / "results", tmp_path / "docs" / "results.md", tmp_path / "README.md"
    readme.write_text(f"{render.BEGIN}\n{render.END}\n", encoding="utf-8")
    guide = tmp_path / "docs" / "guide.md"
    guide.parent.mkdir(parents=True)
    guide.write_text("# guide\n\n<!-- results:toy:begin -->\n<!-- results:toy:end -->\n\nafter\n", encoding="utf-8")
    render.render(results, docs, readme)
    assert "No record yet." in guide.read_text(encoding="utf-8")  # no bench/toy.py: no command to point to
    assert "No record yet: run `bench/offpolicy.py`." in render.bench_block([], "offpolicy", guide, docs)
    record.save_record(_record(record, table={"columns": ["arm", "runs/s"], "rows": [["fast", 2.0]]}), results)
    assert any(str(guide) in p for p in render.check(results, docs, readme))
    render.render(results, docs, readme)
    text = guide.read_text(encoding="utf-8")
    assert text.startswith("# guide\n\n<!-- results:toy:begin -->") and text.endswith("<!-- results:toy:end -->\n\nafter\n")
    assert "| fast | 2 |" in text and "The toy ran twice as fast as its baseline." in text
    assert "(results.md#toy-" in text  # linked to its section
    assert render.check(results, docs, readme) == []


def test_check_says_when_the_readme_has_no_markers(mods: tuple[ModuleType, ModuleType], tmp_path: Path) -> None:
    record, render = mods
    readme = tmp_path / "README.md"
    readme.write_text("# toy\n", encoding="utf-8")
    record.save_record(_record(record), tmp_path / "results")
    problems = render.check(tmp_path / "results", tmp_path / "results.md", readme)
    assert any("no `<!-- results:begin -->`" in p for p in problems), problems


def test_bad_input_is_a_value_error_naming_it(mods: tuple[ModuleType, ModuleType]) -> None:
    record, _ = mods
    with pytest.raises(ValueError, match="bench: .*'Bad Name'"):
        _record(record, bench="Bad Name")
    with pytest.raises(ValueError, match=r"figures\['runs/s'\]"):
        _record(record, figures={"runs/s": {"nested": 1}})
    with pytest.raises(ValueError, match="headline.rank"):
        _record(record, headline={"row": "toy", "value": "1x", "rank": 0})
    with pytest.raises(ValueError, match="summary"):
        _record(record, summary="two\nlines")
    # NaN is not JSON: a figure that could not be measured is written as null
    assert _record(record, figures={"runs/s": float("nan")})["figures"] == {"runs/s": None}


def test_machine_kind_from_the_flags_and_the_avx2_emulation(mods: tuple[ModuleType, ModuleType],
                                                           tmp_path: Path) -> None:
    record, _ = mods
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9R14 96-Core Processor\ncpu family\t: 25\n"
                       "model\t\t: 17\nflags\t\t: fpu sse2 avx2 fma\n\nprocessor\t: 1\n", encoding="utf-8")
    plain = record.machine_info(cpuinfo, env={})
    assert (plain["kind"], plain["family"], plain["model"], plain["flags"]) == ("x86-avx2", 25, 17, ["avx2", "fma"])
    assert plain["emulated_on"] is None
    # what bench/as_avx2.sh exports: the real CPU and flags, hidden from /proc/cpuinfo
    env = {"SISRL_AS_AVX2_REAL_CPU": "AMD EPYC 9R14, family 25 model 17",
           "SISRL_AS_AVX2_REAL_FLAGS": "avx2 avx512f avx512_bf16 ", "ATEN_CPU_CAPABILITY": "avx2"}
    emulated = record.machine_info(cpuinfo, env=env)
    assert emulated["kind"] == "x86-avx2" and emulated["isa_caps"] == {"ATEN_CPU_CAPABILITY": "avx2"}
    assert emulated["emulated_on"] == {"kind": "x86-avx512-bf16", "cpu": "AMD EPYC 9R14, family 25 model 17",
                                       "flags": ["avx2", "avx512_bf16", "avx512f"]}
    assert record.command_line(["bench/toy.py", "--x", "a b"], env=env).startswith("bench/as_avx2.sh ")
    assert record.machine_kind({"avx2", "avx512f", "amx_bf16"}) == "x86-amx"
    assert record.machine_kind({"avx2", "avx512f"}) == "x86-avx512"
    assert record.machine_kind({"sse2"}) == "x86"
