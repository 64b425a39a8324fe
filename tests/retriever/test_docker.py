"""docker-compose.yml and Dockerfile: valid for the compose tool when one is installed (no engine needed), and
always checked for what the image must offer: a `retriever` service that builds from a mounted corpus, then serves,
with a healthcheck on /health, and a command our own CLI accepts."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from sisrl.retriever.cli import make_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"


def compose_command() -> list[str] | None:
    """`docker compose` (CLI plugin) or the legacy `docker-compose`, whichever is installed; None if neither."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def test_compose_file_passes_the_compose_tool(tmp_path: Path) -> None:
    tool = compose_command()
    if tool is None:
        pytest.skip("neither `docker compose` (CLI plugin) nor `docker-compose` is installed here")
    result = subprocess.run([*tool, "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr.decode()


def _expand(value: str) -> str:
    """Compose's `${NAME:-default}` with every variable unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def test_retriever_service_builds_then_serves_with_a_healthcheck() -> None:
    spec = yaml.safe_load(COMPOSE.read_text())
    service = spec["services"]["retriever"]
    assert (ROOT / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
    command = [_expand(str(part)) for part in service["command"]]
    args = make_parser().parse_args(command)
    assert args.command == "serve" and str(args.corpus).startswith("/data/") and str(args.index).startswith("/data/")
    mounts = [_expand(volume).split(":")[1] for volume in service["volumes"]]
    assert "/data" in mounts
    health = service["healthcheck"]
    assert health["test"][0] == "CMD" and "/health" in " ".join(health["test"])
    assert all(str(port).startswith("127.0.0.1:") for port in service["ports"])


def test_dockerfile_runs_the_same_cli() -> None:
    text = (ROOT / "Dockerfile").read_text()
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    assert json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1)) == ["sisrl-retriever"]  # type: ignore[union-attr]
    assert make_parser().parse_args(cmd).command == "serve"
    assert "HEALTHCHECK" in text and "/health" in text
