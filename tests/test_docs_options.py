"""The option tables of the docs against the code they describe.

The tables of docs/retriever.md (build, import, serve, eval), docs/gateway.md (serve) and docs/trainer.md (`sisrl-train
eval`, `sisrl-data prepare` / `demo`) against the CLIs' own parsers: every flag a table names exists, every flag
a parser has is in its table (an alias counts through its option), and each default a table gives is the one the
parser's help prints; defaults that are prose ("from manifest", "the model") only have to be unset in the code.
docs/trainer.md's knob table is `sisrl-train config`'s, row for row.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest
from sisrl.retriever.cli import make_parser
from sisrl.services.cli import build_parser
from sisrl.trainer.cli import build_parser as train_parser
from sisrl.trainer.cli import main as train_main
from sisrl.trainer.config import describe_fields
from sisrl.trainer.data_cli import build_parser as data_parser

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise AssertionError(f"{parser.prog} has no subcommands")


def _section(doc: str, start: str, end: str) -> str:
    text = (DOCS / doc).read_text(encoding="utf-8")
    a = text.index(start)
    return text[a:text.index(end, a + len(start))]


def _table(text: str) -> list[tuple[list[str], str]]:
    """(flags, default cell) of each `| `--flag` | default | meaning |` row."""
    rows = []
    for line in text.splitlines():
        if line.startswith("| `--"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.append((re.findall(r"`(--[a-z0-9-]+)`", cells[0]), cells[1]))
    return rows


def _help_default(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """What `--help` prints after `default:` (written by common/cli.py, or added by the parser's formatter as in
    sisrl-train and sisrl-data), or `required`."""
    text = parser._get_formatter()._expand_help(action)
    found = re.search(r"\((required|default: ([^()]*?))(; env [A-Z0-9_]+)?\)$", text)
    assert found, f"{action.option_strings}: help {text!r} names no default"
    return "required" if found.group(1) == "required" else found.group(2)


def _same(doc: str, code: str) -> bool:
    value = doc.strip("`")
    if code.startswith("["):  # a list default (nargs="+"): the doc gives it as typed, `hotpotqa nq`
        return doc.startswith("`") and value.split() == [str(v) for v in ast.literal_eval(code)]
    if doc in ("on", "off"):
        return code == str(doc == "on")
    if (size := re.fullmatch(r"(\d+) MiB", doc)) is not None:
        return code == str(int(size.group(1)) * 2**20)
    if doc.startswith("`") or re.fullmatch(r"[0-9.]+", doc) or doc == "required":
        try:
            return float(value) == float(code)
        except ValueError:
            return value == code
    return code in ("unset", "", "None")  # prose: "none", "unset", "empty", "from manifest", "the model"


CASES = {
    "retriever build": ("retriever.md", "## Build", "## Import", lambda: _subcommand(make_parser(), "build")),
    "retriever import": ("retriever.md", "## Import", "## Serve", lambda: _subcommand(make_parser(), "import")),
    "retriever serve": ("retriever.md", "## Serve", "### API", lambda: _subcommand(make_parser(), "serve")),
    "retriever eval": ("retriever.md", "## Eval", "## Index types", lambda: _subcommand(make_parser(), "eval")),
    "gateway serve": ("gateway.md", "## Running it", "## Several gateways", lambda: _subcommand(build_parser(),
                                                                                                 "serve")),
    "train eval": ("trainer.md", "### `sisrl-train eval`", "### `sisrl-data prepare`",
                   lambda: _subcommand(train_parser(), "eval")),
    "data prepare": ("trainer.md", "### `sisrl-data prepare`", "### `sisrl-data demo`",
                     lambda: _subcommand(data_parser(), "prepare")),
    "data demo": ("trainer.md", "### `sisrl-data demo`", "\n## ", lambda: _subcommand(data_parser(), "demo")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_option_tables_match_the_parsers(case: str) -> None:
    doc, start, end, make = CASES[case]
    parser = make()
    actions = {flag: a for a in parser._actions for flag in a.option_strings if flag.startswith("--")}
    rows = _table(_section(doc, start, end))
    assert rows, f"docs/{doc} {start!r}: no option table found"
    documented = {flag for flags, _ in rows for flag in flags}
    unknown = sorted(documented - set(actions))
    assert not unknown, f"docs/{doc} {start!r} names flags {case} does not have: {unknown}"
    missing = sorted({a.option_strings[0] for a in actions.values()
                      if a.option_strings[0] != "-h" and not documented & set(a.option_strings)})
    assert not missing, f"docs/{doc} {start!r}: {case} flags without a row: {missing}"
    wrong = []
    for flags, cell in rows:
        named = [f for f in flags if not f.startswith("--no-")]
        defaults = [d.strip() for d in re.split(r",\s+|\s+/\s+", cell)]  # `1,3,10` is one default
        if len(defaults) == 1:  # one cell for the whole row ("model's prompts")
            defaults *= len(named)
        assert len(defaults) == len(named), f"docs/{doc}: row {flags} gives {len(defaults)} defaults: {cell!r}"
        for flag, default in zip(named, defaults, strict=True):
            if not _same(default, code := _help_default(parser, actions[flag])):
                wrong.append(f"{flag}: docs {default!r}, code {code!r}")
    assert not wrong, f"docs/{doc} {start!r} defaults differ from {case}: {wrong}"


def test_a_wrong_default_is_caught() -> None:
    assert _same("`64`", "64") and _same("8 MiB", "8388608") and _same("off", "False") and _same("unset", "unset")
    assert _same("none", "None") and _same("`hotpotqa nq`", "['hotpotqa', 'nq']") and _same("`1,3,10`", "1,3,10")
    assert not _same("`32`", "64") and not _same("on", "False") and not _same("none", "8000")
    assert not _same("`nq`", "['hotpotqa', 'nq']") and not _same("both", "['hotpotqa', 'nq']")


def test_the_trainer_knob_table_is_sisrl_train_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert train_main(["config", "--markdown"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed.startswith("| key | default | description |") and printed in (DOCS / "trainer.md").read_text()
    rows = []
    for line in _section("trainer.md", "## Configuration knobs", "\n## ").splitlines():
        if line.startswith("| `"):
            key, default, description = (c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1])
            rows.append((key.strip("`"), default.strip("`"), description.replace("\\|", "|")))
    assert rows == describe_fields(), (
        "docs/trainer.md's knob table differs from the config: replace it with `sisrl-train config --markdown`")
