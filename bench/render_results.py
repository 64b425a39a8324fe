"""Render docs/results.md and the README's headline table from the bench records under bench/results/.

docs/results.md: one section per bench (its title, what it measures), then for each machine kind the latest
record: its summary sentence, the machine, commit, date and command, its figures against the baseline of the same
run (with the ratio where both have a figure of the same name), its table if it has one, its figure if its bench
wrote one (a PNG of the record's name beside it); then links to the older
records of that bench. README.md: between `<!-- results:begin -->` and `<!-- results:end -->`, a table of the
records that carry a `headline` (at most 10 rows, one column per machine kind, each cell the latest record's value
linked to its section). A page under docs/ may hold `<!-- results:BENCH:begin -->` ... `<!-- results:BENCH:end -->`:
the latest record of BENCH per machine kind goes there (its summary, table and a link to its section), so a
guide can show a measured table without a hand-written figure. The output depends on the records alone (no time
of rendering), so `--check` can tell whether the committed files are current.

    .venv/bin/python bench/render_results.py            # write docs/results.md and the README block
    .venv/bin/python bench/render_results.py --check    # exit 1 naming each stale file (tests/test_results.py)
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from record import KINDS, RESULTS, ROOT, load_record

DOCS = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
MAX_HEADLINE_ROWS = 10
BLOCK = re.compile(r"<!-- results:([a-z][a-z0-9_]*):begin -->.*?<!-- results:\1:end -->", re.DOTALL)
RENDER_COMMAND = ".venv/bin/python bench/render_results.py"
OTHER_KINDS = {"unknown": "the log did not name the machine", "mixed": "parts of the run on different machines"}

Record = tuple[Path, dict[str, Any]]


def load_records(results_dir: Path) -> list[Record]:
    """Every `<bench>/*.json` under `results_dir`, validated, oldest first (date, then file name; undated
    first)."""
    records = [(path, load_record(path)) for path in sorted(results_dir.glob("*/*.json"))]
    return sorted(records, key=lambda r: (r[1]["date"] or "", r[0].name))


def kind_order(kinds: Iterable[str]) -> list[str]:
    """The known kinds in the order of KINDS, then others by name, `mixed` and `unknown` last."""
    known = [k for k in KINDS if k in kinds]
    last = [k for k in ("mixed", "unknown") if k in kinds]
    return known + sorted(set(kinds) - set(known) - set(last)) + last


def latest_per_kind(records: list[Record]) -> tuple[dict[str, Record], list[Record]]:
    """({kind: its latest record}, the rest newest first) for the records of one bench."""
    latest: dict[str, Record] = {}
    for item in records:  # oldest first: the last one of a kind wins
        latest[item[1]["machine"]["kind"]] = item
    shown = {id(item) for item in latest.values()}
    return latest, [item for item in reversed(records) if id(item) not in shown]


def fmt(value: Any) -> str:
    """A figure as text: ints with thousands separators, floats to 6 significant digits, lists joined."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.6g}"
    if isinstance(value, list):
        return ", ".join(fmt(v) for v in value)
    return str(value)


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def ratio(mine: Any, theirs: Any) -> str:
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (mine, theirs))
    return f"{mine / theirs:.3g}x" if numbers and theirs != 0 else "-"


def figures_table(record: dict[str, Any]) -> list[str]:
    figures, baseline = record["figures"], record["baseline"]
    if baseline is None:
        rows = ["| figure | this run |", "|---|---|"]
        return rows + [f"| {cell(name)} | {cell(fmt(v))} |" for name, v in figures.items()]
    theirs = baseline["figures"]
    rows = [f"| figure | this run | baseline: {cell(baseline['what'])} | this run / baseline |", "|---|---|---|---|"]
    names = list(figures) + [name for name in theirs if name not in figures]
    for name in names:
        mine, base = figures.get(name), theirs.get(name)
        rows.append(f"| {cell(name)} | {cell(fmt(mine))} | {cell(fmt(base))} | {ratio(mine, base)} |")
    return rows


def machine_line(machine: dict[str, Any]) -> str:
    parts = [machine["cpu"] or "CPU not logged"]
    if machine["family"] is not None and machine["model"] is not None:
        parts.append(f"family {machine['family']} model {machine['model']}")
    if machine["cores"] is not None:
        parts.append(f"{machine['cores']} cores")
    if machine["flags"]:
        parts.append("flags " + " ".join(machine["flags"]))
    line = ", ".join(parts)
    if machine.get("isa_caps"):
        line += "; capped by " + " ".join(f"{k}={v}" for k, v in sorted(machine["isa_caps"].items()))
    real = machine.get("emulated_on")
    if real is not None:
        line += (f"; **emulated** through bench/as_avx2.sh on a `{real['kind']}` machine"
                 f" ({real['cpu'] or 'CPU not logged'})")
    return line


def kind_section(path: Path, record: dict[str, Any], docs: Path) -> list[str]:
    kind, commit = record["machine"]["kind"], record["commit"]
    sha = f"`{commit['sha']}`" if commit["sha"] else "not logged"
    if commit["dirty"]:
        sha += " (uncommitted changes)"
    lines = [f'<a id="{record["bench"]}-{kind}"></a>', "", f"### `{kind}`", "", record["summary"], "",
             f"- machine: {machine_line(record['machine'])}",
             f"- commit {sha}, date {record['date'] or 'not logged'}; [record]({link(path, docs)})",
             f"- command: `{record['command']}`" if record["command"] else "- command: not logged"]
    if record["source"]:
        lines.append(f"- source: {record['source']}")
    if record["notes"]:
        lines.append(f"- notes: {record['notes']}")
    lines += ["", *figures_table(record)]
    table = record["table"]
    if table is not None:
        lines += ["", "| " + " | ".join(cell(str(c)) for c in table["columns"]) + " |",
                  "|" + "---|" * len(table["columns"])]
        lines += ["| " + " | ".join(cell(fmt(v)) for v in row) + " |" for row in table["rows"]]
    return lines + [*figure_line(path, record, docs), ""]


def figure_line(path: Path, record: dict[str, Any], page: Path) -> list[str]:
    """The record's figure (a PNG of the same name beside it, written by its bench), as an image link."""
    png = path.with_suffix(".png")
    return ["", f"![{record['title']}]({link(png, page)})"] if png.is_file() else []


def link(path: Path, page: Path) -> str:
    return Path(os.path.relpath(path.resolve(), page.resolve().parent)).as_posix()


def render_docs(records: list[Record], docs: Path) -> str:
    """The whole of docs/results.md."""
    by_bench: dict[str, list[Record]] = {}
    for item in records:
        by_bench.setdefault(item[1]["bench"], []).append(item)
    kinds = {**KINDS, **OTHER_KINDS}
    lines = ["# Results", "",
             f"Rendered by `bench/render_results.py` from the JSON records under `bench/results/`: do not edit it by "
             f"hand. A bench writes its record at the end of a run; then `{RENDER_COMMAND}` renders this page and "
             "the README's table. Each section gives the latest record of a bench on each machine kind, its "
             "figures beside the baseline measured in the same run, and links to the older records. Records "
             "imported from the logs of earlier runs say so under `source`.", "", "Machine kinds:", ""]
    lines += [f"- `{k}`: {v}" for k, v in kinds.items()]
    lines += ["", "Benches: " + " · ".join(f"[{b}](#{b})" for b in sorted(by_bench)), ""]
    for bench in sorted(by_bench):
        items = by_bench[bench]
        latest, older = latest_per_kind(items)
        head = items[-1][1]
        lines += [f'<a id="{bench}"></a>', "", f"## {head['title']}", "", head["measures"], ""]
        for kind in kind_order(latest):
            lines += kind_section(*latest[kind], docs)
        if older:
            lines += ["Older records: " + " · ".join(
                f"[{r['date'] or 'undated'} `{r['machine']['kind']}` {r['commit']['sha'] or 'no commit'}]"
                f"({link(p, docs)})" for p, r in older), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def render_headline(records: list[Record], docs: Path, readme: Path) -> str:
    """The README block, markers included: one row per headline (by rank), one column per machine kind."""
    cells: dict[str, dict[str, Record]] = {}
    ranks: dict[str, int] = {}
    for item in records:  # oldest first: the latest of a (row, kind) wins
        headline = item[1]["headline"]
        if headline is not None:
            cells.setdefault(headline["row"], {})[item[1]["machine"]["kind"]] = item
            ranks[headline["row"]] = min(ranks.get(headline["row"], 99), headline["rank"])
    if len(cells) > MAX_HEADLINE_ROWS:
        raise ValueError(f"headline rows: expected at most {MAX_HEADLINE_ROWS}, got {len(cells)}: {sorted(cells)}")
    kinds = kind_order({kind for row in cells.values() for kind in row})
    page = link(docs, readme)
    lines = [BEGIN, f"<!-- rendered by bench/render_results.py from bench/results/: edit the records, not this "
                    f"table ({RENDER_COMMAND}) -->", "",
             "| | " + " | ".join(f"`{k}`" for k in kinds) + " |", "|---|" + "---|" * len(kinds)]
    for row in sorted(cells, key=lambda r: (ranks[r], r)):
        out = []
        for kind in kinds:
            if kind not in cells[row]:
                out.append("-")
                continue
            _, record = cells[row][kind]
            note = record["date"][:10] if record["date"] else "undated"
            real = record["machine"].get("emulated_on")
            if real is not None:
                note += f", emulated on `{real['kind']}`"
            out.append(f"[{cell(record['headline']['value'])}]({page}#{record['bench']}-{kind}) ({note})")
        lines.append(f"| {cell(row)} | " + " | ".join(out) + " |")
    names = {**KINDS, **OTHER_KINDS}
    lines += ["", "Machine kinds: " + "; ".join(f"`{k}` {names.get(k, 'see the record')}" for k in kinds) +
              f". Every figure, its command, commit and baseline: [{page}]({page}).", END]
    return "\n".join(lines)


def bench_block(records: list[Record], bench: str, page: Path, docs: Path) -> str:
    """The block of `page` for `bench`, markers included: per machine kind, the latest record's summary, its
    table (or figures) and a link to its section of docs/results.md."""
    latest, _ = latest_per_kind([item for item in records if item[1]["bench"] == bench])
    lines = [f"<!-- results:{bench}:begin -->", f"<!-- rendered by bench/render_results.py from bench/results/"
                                                 f"{bench}/: edit the records, not this block -->", ""]
    if not latest:
        script = f"bench/{bench}.py"
        lines += [f"No record yet: run `{script}`." if (ROOT / script).is_file() else "No record yet.", ""]
    for kind in kind_order(latest):
        path, record = latest[kind]
        where = f"{link(docs, page)}#{bench}-{kind}"
        lines += [f"`{kind}` ({machine_line(record['machine'])}; {record['date'] or 'undated'}): "
                  f"{record['summary']} [Record and command]({where}).", ""]
        table = record["table"]
        if table is not None:
            lines += ["| " + " | ".join(cell(str(c)) for c in table["columns"]) + " |",
                      "|" + "---|" * len(table["columns"])]
            lines += ["| " + " | ".join(cell(fmt(v)) for v in row) + " |" for row in table["rows"]]
        else:
            lines += figures_table(record)
        lines += [*figure_line(path, record, page), ""]
    return "\n".join([*lines, f"<!-- results:{bench}:end -->"])


def render_pages(records: list[Record], docs: Path) -> dict[Path, str]:
    """Every other page under docs/ that holds result blocks -> its text with the blocks rendered."""
    out: dict[Path, str] = {}
    for page in sorted(docs.parent.rglob("*.md")):
        if page.resolve() == docs.resolve():
            continue
        text = page.read_text(encoding="utf-8")
        if BLOCK.search(text):
            out[page] = BLOCK.sub(lambda m, page=page: bench_block(records, m.group(1), page, docs), text)
    return out


def splice(readme_text: str, block: str, readme: Path) -> str:
    """`readme_text` with the part between the markers (markers included) replaced by `block`."""
    start, stop = readme_text.find(BEGIN), readme_text.find(END)
    if start < 0 or stop < start:
        raise ValueError(f"{readme}: no `{BEGIN}` ... `{END}` markers; put them where the results table goes "
                         "(the top of its results section), then run " + RENDER_COMMAND)
    return readme_text[:start] + block + readme_text[stop + len(END):]


def check(results_dir: Path = RESULTS, docs: Path = DOCS, readme: Path = README) -> list[str]:
    """What is stale or missing, one line each; empty when both files are what the records render."""
    records = load_records(results_dir)
    problems = []
    if not docs.is_file() or docs.read_text(encoding="utf-8") != render_docs(records, docs):
        problems.append(f"{docs}: not what the records render")
    text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    try:
        spliced = splice(text, render_headline(records, docs, readme), readme)
    except ValueError as err:
        problems.append(str(err))
    else:
        if spliced != text:
            problems.append(f"{readme}: the results block is not what the records render")
    for page, rendered in render_pages(records, docs).items():
        if page.read_text(encoding="utf-8") != rendered:
            problems.append(f"{page}: a results block is not what the records render")
    return problems


def render(results_dir: Path = RESULTS, docs: Path = DOCS, readme: Path = README) -> None:
    """Write docs/results.md, the README block between its markers (ValueError when it has none, after
    writing docs/results.md) and the result blocks of other pages under docs/."""
    records = load_records(results_dir)
    _write(docs, render_docs(records, docs))
    text = readme.read_text(encoding="utf-8")
    spliced = splice(text, render_headline(records, docs, readme), readme)
    if spliced != text:
        _write(readme, spliced)
    for page, rendered in render_pages(records, docs).items():
        if page.read_text(encoding="utf-8") != rendered:
            _write(page, rendered)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each stale file")
    p.add_argument("--results", type=Path, default=RESULTS, help="records folder (default: bench/results)")
    p.add_argument("--docs", type=Path, default=DOCS, help="results page (default: docs/results.md)")
    p.add_argument("--readme", type=Path, default=README, help="README with the markers (default: README.md)")
    args = p.parse_args(argv)
    try:
        if args.check:
            problems = check(args.results, args.docs, args.readme)
            for line in problems:
                print(f"stale: {line}", file=sys.stderr)
            if problems:
                print(f"run: {RENDER_COMMAND}", file=sys.stderr)
            return 1 if problems else 0
        render(args.results, args.docs, args.readme)
    except ValueError as err:
        print(f"bench/render_results.py: {err}", file=sys.stderr)
        return 1
    print(f"rendered {args.docs} and the results block of {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
