"""Fixtures shared by every test package."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """`../shared/data` beside the clone (NQ, HotpotQA, a Wikipedia passage corpus); skip when absent."""
    if not (SHARED_DATA / "corpus" / "wiki_passages.jsonl").is_file():
        pytest.skip(f"shared data not found at {SHARED_DATA} (a clone outside this workplace)")
    return SHARED_DATA


def run_schemathesis(openapi_url: str, *, token: str | None = None, examples: int = 40, seed: int = 1,
                     base_url: str | None = None, exclude: tuple[str, ...] = (), phases: str | None = None) -> str:
    """`schemathesis run --checks all` against a live server's OpenAPI document (the CLI a user runs);
    fails the test with schemathesis' own report unless every check passes. Returns the report.
    `base_url`: the server, when `openapi_url` is a file; `exclude`: checks left out (say why at the call)."""
    command = [str(Path(sys.executable).with_name("schemathesis")), "run", "--checks", "all",
               "--max-examples", str(examples), "--seed", str(seed), "--no-color",
               "--request-timeout", "60", openapi_url]
    if token is not None:
        command[2:2] = ["-H", f"Authorization: Bearer {token}"]
    if base_url is not None:
        command[2:2] = ["--url", base_url]
    if exclude:
        command[2:2] = ["--exclude-checks", ",".join(exclude)]
    if phases:
        command[2:2] = ["--phases", phases]
    # cwd: schemathesis keeps a .schemathesis/ folder of its own there, which must not land in the clone
    done = subprocess.run(command, capture_output=True, text=True, timeout=110, cwd=tempfile.gettempdir())
    report = done.stdout + done.stderr
    if done.returncode != 0:
        failures = report[report.find("FAILURES"):report.find("SUMMARY")] if "FAILURES" in report else report
        pytest.fail(f"schemathesis found failures on {openapi_url} (token: {token is not None}):\n"
                    f"{failures[:12000]}\n{report[report.find('SUMMARY'):][-3000:]}", pytrace=False)
    return report
