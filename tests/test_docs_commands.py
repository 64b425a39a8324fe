"""The commands the README and the docs print, against the code: every `sisrl-*` command line names a
subcommand and flags its parser has, every `make` target exists, every script runs its `--help`, and every
relative link points at a file that is there."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from sisrl.retriever.cli import make_parser as retriever_parser
from sisrl.services.cli import build_parser as gateway_parser
from sisrl.trainer.cli import build_parser as train_parser
from sisrl.trainer.data_cli import build_parser as data_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PARSERS = {"sisrl-retriever": retriever_parser, "sisrl-gateway": gateway_parser, "sisrl-train": train_parser,
           "sisrl-data": data_parser, "sisrl.trainer.cli": train_parser}


def _code(text: str) -> list[str]:
    """Every line of every fenced block, and every inline code span, joined over `\\` continuations."""
    spans = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    lines = [ln for block in spans for ln in block.replace("\\\n", " ").splitlines()]
    inline = re.sub(r"```.*?```", "", text, flags=re.S)
    return lines + [m.replace("\n", " ") for m in re.findall(r"`([^`]+)`", inline)]


def _commands() -> list[tuple[str, str]]:
    """(page, command) for each `sisrl-*` (or `-m sisrl.trainer.cli`) invocation the pages print."""
    out = []
    for page in PAGES:
        for line in _code(page.read_text(encoding="utf-8")):
            line = line.split(" #")[0]
            m = re.search(r"(?:^|\s|/)(sisrl-(?:retriever|gateway|train|data)|sisrl\.trainer\.cli)\s+(\S.*)?$", line)
            if m:
                out.append((page.relative_to(ROOT).as_posix(), f"{m.group(1)} {m.group(2) or ''}".strip()))
    return out


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None


def test_the_pages_print_commands() -> None:
    assert len(_commands()) >= 10, "the command scan found almost nothing: is the regex still right?"


@pytest.mark.parametrize(("page", "command"), _commands())
def test_each_printed_command_has_its_subcommand_and_flags(page: str, command: str) -> None:
    words = shlex.split(command.replace("...", ""), posix=True) if command.count("'") % 2 == 0 else command.split()
    program, rest = words[0], words[1:]
    parser = PARSERS[program]()
    if not rest or rest[0].startswith("-") or rest[0] in ("[options]", "SUBCOMMAND"):
        return  # the program alone, or its --help
    if rest[0].endswith(":"):
        return  # a message the program prints (`sisrl-retriever serve: error: ...`), not a command
    sub = _subparser(parser, rest[0])
    assert sub is not None, f"{page}: `{command}`: {program} has no subcommand {rest[0]!r}"
    known = {flag for action in sub._actions for flag in action.option_strings}
    unknown = [w.split("=")[0] for w in rest[1:] if w.startswith("--") and w.split("=")[0] not in known]
    assert unknown == [], f"{page}: `{command}`: {program} {rest[0]} has no {unknown}"


def _make_targets() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return sorted({m for line in _code(text) for m in re.findall(r"^make ([a-z-]+)", line.strip())})


def test_every_make_target_the_readme_names_exists() -> None:
    targets = _make_targets()
    assert {"demo", "test"} <= set(targets), "the README lost its two set-up commands"
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    missing = [t for t in targets if not re.search(rf"^{re.escape(t)}:", makefile, re.M)]
    assert missing == [], f"README names make targets the Makefile lacks: {missing}"


def test_every_bench_script_the_readme_runs_answers_help() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    scripts = sorted({m for line in _code(text) for m in re.findall(r"python (bench/[a-z_]+\.py)", line)})
    assert scripts, "the README runs no bench script any more"
    for script in scripts:
        done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, f"{script} --help: {done.stderr[-500:]}"


def test_relative_links_point_at_files_that_exist() -> None:
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == [], "broken links:\n" + "\n".join(broken)
