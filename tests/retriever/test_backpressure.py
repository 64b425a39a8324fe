"""Bounded work and start-up warnings of `sisrl-retriever serve`, as real processes on loopback: with one request
in flight and no queue, a second is answered 429 with Retry-After while the first completes; a token on the
command line and an open non-loopback bind are warned about (sisrl.common.admission, sisrl.common.secrets)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.retriever.conftest import TOPICS, Server, start_server, stop_server

BIG = 300  # queries in the request that holds the only place: seconds of encoding on one thread


@pytest.fixture(scope="module")
def one_slot(minilm_index: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(minilm_index, tmp_path_factory.mktemp("logs") / "one_slot.log", "--max-in-flight", "1",
                          "--max-queued", "0", "--cache-size", "0", "--dtype", "float32")
    yield server
    stop_server(server)


def in_flight(server: Server) -> float:
    found = re.search(r"^sisrl_retriever_in_flight (\S+)$", httpx.get(f"{server.url}/metrics", timeout=10).text,
                      re.MULTILINE)
    assert found, "no sisrl_retriever_in_flight in /metrics"
    return float(found.group(1))


def test_a_request_past_the_cap_gets_429_with_retry_after_and_the_running_one_completes(one_slot: Server) -> None:
    queries = [f"{TOPICS[i % len(TOPICS)][1]} (variant {i})" for i in range(BIG)]  # distinct: no dedupe
    answers: list[httpx.Response] = []
    big = threading.Thread(target=lambda: answers.append(one_slot.retrieve({"queries": queries, "topk": 1})))
    big.start()
    deadline = time.monotonic() + 30
    while in_flight(one_slot) != 1:
        assert time.monotonic() < deadline and big.is_alive(), "the large request never showed as in flight"
        time.sleep(0.01)
    refused = one_slot.retrieve({"queries": ["jazz"], "topk": 1})
    big.join(120)
    assert refused.status_code == 429, f"{refused.status_code}: {refused.text} (did the large request end first?)"
    assert int(refused.headers["retry-after"]) >= 1
    assert "(settings max_in_flight, max_queued)" in refused.json()["detail"]
    (done,) = answers
    assert done.status_code == 200 and len(done.json()["result"]) == BIG
    assert in_flight(one_slot) == 0
    assert one_slot.retrieve({"queries": ["jazz"], "topk": 1}).json()["result"][0][0]["id"] == "doc5"


def _serve_stderr(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """`sisrl-retriever serve` on an index that does not exist: it warns, then stops before it loads or binds."""
    merged = {k: v for k, v in os.environ.items() if not k.startswith("SISRL_RETRIEVER_")} | (env or {})
    done = subprocess.run([sys.executable, "-m", "sisrl.retriever.cli", "serve", "--index", str(tmp_path / "none"),
                           "--port", "0", *args], capture_output=True, text=True, timeout=120, env=merged)
    assert done.returncode == 2, done.stderr
    return done.stderr


def test_a_token_on_the_command_line_and_an_open_bind_are_warned_about(tmp_path: Path) -> None:
    stderr = _serve_stderr(tmp_path, "--api-token", "retriever-token-0123456789")
    assert ("--api-token puts a secret in the process list (ps, /proc/<pid>/cmdline); set SISRL_RETRIEVER_API_TOKEN "
            "(or SISRL_RETRIEVER_API_TOKEN_FILE, a file holding it) instead") in stderr
    assert "beyond loopback" not in stderr
    stderr = _serve_stderr(tmp_path, "--host", "0.0.0.0")  # stops at the missing index: nothing is bound
    assert "the retriever listens on 0.0.0.0:0, beyond loopback, with no token" in stderr
    assert "set SISRL_RETRIEVER_API_TOKEN (or SISRL_RETRIEVER_API_TOKEN_FILE), or bind 127.0.0.1" in stderr
    quiet = _serve_stderr(tmp_path, "--host", "0.0.0.0", env={"SISRL_RETRIEVER_API_TOKEN": "retriever-token-0123456789"})
    assert "beyond loopback" not in quiet and "process list" not in quiet
