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


# schemathesis' own default for positive_data_acceptance (a schema-valid request may get these), to which an API
# adds the status of a rule its schema cannot state and its OpenAPI document lists for that route.
POSITIVE_DEFAULT = ("2xx", "3xx", "401", "403", "404", "409", "429", "5xx")


def run_schemathesis(openapi_url: str, *, token: str | None = None, examples: int = 40, seed: int = 1,
                     base_url: str | None = None, exclude: tuple[str, ...] = (), phases: str | None = None,
                     also_accept: tuple[str, ...] = ()) -> str:
    """`schemathesis run --checks all` against a live server's OpenAPI document (the CLI a user runs);
    fails the test with schemathesis' own report unless every check passes. Returns the report.
    `base_url`: the server, when `openapi_url` is a file; `exclude`: checks left out (say why at the call);
    `also_accept`: statuses positive_data_acceptance allows beyond its default (say why at the call; never 422,
    which would hide a schema that promises more than the server accepts)."""
    assert "422" not in also_accept and "4xx" not in also_accept, also_accept
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
    if also_accept:  # a global option: before `run`
        config = Path(tempfile.mkdtemp(prefix="sisrl-schemathesis-")) / "schemathesis.toml"
        statuses = ", ".join(f'"{s}"' for s in (*POSITIVE_DEFAULT, *also_accept))
        config.write_text(f"[checks.positive_data_acceptance]\nexpected-statuses = [{statuses}]\n")
        command[1:1] = ["--config-file", str(config)]
    # cwd: schemathesis keeps a .schemathesis/ folder of its own there, which must not land in the clone
    done = subprocess.run(command, capture_output=True, text=True, timeout=110, cwd=tempfile.gettempdir())
    report = done.stdout + done.stderr
    if done.returncode != 0:
        failures = report[report.find("FAILURES"):report.find("SUMMARY")] if "FAILURES" in report else report
        pytest.fail(f"schemathesis found failures on {openapi_url} (token: {token is not None}):\n"
                    f"{failures[:12000]}\n{report[report.find('SUMMARY'):][-3000:]}", pytrace=False)
    return report
