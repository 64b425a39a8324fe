"""The gateway's secrets, through real processes on loopback: the retriever token sent on every search (from a
file) to a retriever that requires one, the 401 a gateway without it gets, the one-line refusal of a short token,
the warnings for a secret on the command line and for a non-loopback bind with no token, and a store-only
gateway's log that shows its database URL without the password (sisrl.common.secrets, services/store.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sisrl.common.procs import free_port, launch_module, wait_healthy
from sisrl.services.cli import main

from tests.services.conftest import STARTUP_S, Gateway, QASubset

RETRIEVER_TOKEN = "retriever-token-0123456789"
SCRIPT = {"rules": [{"match": "", "turns": ["<search>vampire diaries number of seasons</search>",
                                            "<answer>Eight</answer>"]}]}


@pytest.fixture(scope="module")
def token_world(qa_subset: QASubset, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Gateway, Gateway]]:
    """A retriever that requires RETRIEVER_TOKEN (by its env var, never on the command line) and two scripted
    gateways, one given the token by a file, one without it; all three start at once (their start-ups, mostly
    imports, overlap)."""
    tmp = tmp_path_factory.mktemp("token_world")
    port = free_port()
    services = [launch_module("retriever", "sisrl.retriever.cli",
                              ["serve", "--index", str(tmp / "index"), "--corpus", str(qa_subset.corpus), "--encoder",
                               "minilm", "--dtype", "float32", "--port", str(port), "--log-level", "warning",
                               "--torch-threads", "1"],
                              port=port, log=tmp / "retriever.log", env={"SISRL_RETRIEVER_API_TOKEN": RETRIEVER_TOKEN})]
    retriever = services[0].url
    (tmp / "script.json").write_text(json.dumps(SCRIPT))
    (tmp / "retriever_token").write_text(RETRIEVER_TOKEN + "\n")  # as `echo` writes it
    gateways = []
    for name, env in (("with", {"SISRL_GATEWAY_RETRIEVER_TOKEN_FILE": str(tmp / "retriever_token")}),
                      ("without", {})):
        port = free_port()
        db_url = f"sqlite:///{tmp / name}.db"
        args = ["serve", "--port", str(port), "--db-url", db_url, "--engine", "scripted", "--script",
                str(tmp / "script.json"), "--retriever-url", retriever, "--retriever-retries", "0"]
        service = launch_module(f"gateway {name} token", "sisrl.services.cli", args, port=port,
                                log=tmp / f"gateway_{name}.log",
                                env={"SISRL_GATEWAY_LOG_LEVEL": "warning", "SISRL_GATEWAY_API_TOKEN": None,
                                     "SISRL_GATEWAY_RETRIEVER_TOKEN": None, **env})
        services.append(service)
        gateways.append(Gateway(url=service.url, args=args, db_url=db_url, log=service.log, process=service.process))
    wait_healthy(*services, timeout_s=STARTUP_S)
    yield retriever, gateways[0], gateways[1]
    for gateway in gateways:
        gateway.stop()
    services[0].stop()


ITEMS = [{"id": f"q{i}", "question": f"question {i}", "golden_answers": ["Eight"], "data_source": "nq"}
         for i in range(2)]


def test_the_retriever_token_is_sent_on_every_search(token_world: tuple[str, Gateway, Gateway],
                                                     make_body: Callable[..., dict[str, Any]]) -> None:
    _, gateway, _ = token_world
    created = gateway.client.post("/v1/rollouts", json=make_body(ITEMS, max_turns=3)).raise_for_status().json()
    batch = gateway.wait_batch(created["batch_id"], timeout=60)
    assert batch["status"] == "done", batch.get("error")
    for traj in batch["trajectories"]:
        assert traj["error"] is None and traj["answer"] == "Eight"
        (turn,) = traj["turns"]
        assert len(turn["doc_ids"]) == 3  # the retriever answered the search
    assert "401" not in gateway.log.read_text()


def test_without_the_token_the_batch_error_names_the_401_and_the_setting(
        token_world: tuple[str, Gateway, Gateway], make_body: Callable[..., dict[str, Any]]) -> None:
    retriever, _, gateway = token_world
    created = gateway.client.post("/v1/rollouts", json=make_body(ITEMS[:1], max_turns=3)).raise_for_status().json()
    batch = gateway.wait_batch(created["batch_id"], timeout=60)
    assert batch["status"] == "failed"
    assert f"retriever {retriever}/retrieve rejected the request: HTTP 401" in batch["error"], batch["error"]
    assert "set SISRL_GATEWAY_RETRIEVER_TOKEN" in batch["error"]


def test_a_short_retriever_token_is_refused_in_one_line_naming_its_variable(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SISRL_GATEWAY_RETRIEVER_TOKEN", "short-secret")
    with pytest.raises(SystemExit) as info:
        main(["serve", "--engine", "scripted", "--script", "s.json"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert info.value.code == 2
    assert error.startswith("sisrl-gateway: error: SISRL_GATEWAY_RETRIEVER_TOKEN: expected at least 16 "
                            "characters, got 12"), error
    assert "short-secret" not in error


@pytest.mark.parametrize("args", [["--retriever-token", RETRIEVER_TOKEN], [f"--retriever-token={RETRIEVER_TOKEN}"]])
def test_the_retriever_token_is_refused_on_the_command_line(args: list[str],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", *args])
    error = capsys.readouterr().err
    assert ("error: --retriever-token: a secret is not taken on the command line, where every local user can read "
            "it (ps); set SISRL_GATEWAY_RETRIEVER_TOKEN, or give --retriever-token-file FILE") in error
    assert RETRIEVER_TOKEN not in error


def _gateway_stderr(*args: str, env: dict[str, str | None]) -> str:
    """Run `sisrl-gateway serve ARGS` that must stop before it binds (its store is unreachable): its output."""
    merged = {**os.environ, "HF_HUB_OFFLINE": "1", "SISRL_GATEWAY_API_TOKEN": None, **env}
    done = subprocess.run([sys.executable, "-m", "sisrl.services.cli", "serve", *args], capture_output=True,
                          text=True, timeout=120, env={k: v for k, v in merged.items() if v is not None})
    assert done.returncode != 0, done.stderr
    return done.stderr


UNREACHABLE_DB = "postgresql+psycopg://sisrl:hunter2-password@127.0.0.1:9/rollouts"  # port 9: discard, closed


def test_a_token_on_the_command_line_warns_naming_the_env_var() -> None:
    stderr = _gateway_stderr("--store-only", "--db-url", UNREACHABLE_DB, "--port", str(free_port()), "--api-token",
                             "gateway-token-0123456789", env={})
    assert ("--api-token puts a secret in the process list (ps, /proc/<pid>/cmdline); set SISRL_GATEWAY_API_TOKEN "
            "(or SISRL_GATEWAY_API_TOKEN_FILE, a file holding it) instead") in stderr
    assert "hunter2-password" not in stderr and "sisrl:***@127.0.0.1:9" in stderr  # the store error masks it


def test_a_non_loopback_bind_without_a_token_warns() -> None:
    # 0.0.0.0 is never bound: the store is unreachable, so the lifespan fails before uvicorn opens a socket.
    port = str(free_port())
    stderr = _gateway_stderr("--store-only", "--db-url", UNREACHABLE_DB, "--host", "0.0.0.0", "--port", port, env={})
    assert f"the gateway listens on 0.0.0.0:{port}, beyond loopback, with no token" in stderr
    assert "set SISRL_GATEWAY_API_TOKEN (or SISRL_GATEWAY_API_TOKEN_FILE)" in stderr
    quiet = _gateway_stderr("--store-only", "--db-url", UNREACHABLE_DB, "--host", "0.0.0.0", "--port", port,
                            env={"SISRL_GATEWAY_API_TOKEN": "gateway-token-0123456789"})
    assert "beyond loopback" not in quiet and "process list" not in quiet  # a token from the env: no warning


def test_the_store_only_gateway_logs_its_database_url_without_the_password(
        start_gateway: Callable[..., Gateway], pg_url: str) -> None:
    scheme, rest = pg_url.split("://", 1)
    user, host = rest.split("@", 1)
    with_password = f"{scheme}://{user}:hunter2-password@{host}"  # trust auth: the server ignores it
    gateway = start_gateway("--store-only", db_url=with_password, env={"SISRL_GATEWAY_LOG_LEVEL": "info"})
    log = gateway.log.read_text()
    assert f"store-only: serving {scheme}://{user}:***@{host} with no engine" in log, log[-2000:]
    assert "hunter2-password" not in log
