"""Start the retriever and the gateway as real processes on loopback, wait for health, stop them cleanly.

Used by the demo and the end-to-end loop test. Commands are argument lists (no shell); logs go to files.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C (KeyboardInterrupt) so `finally` blocks stop services and close files."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Service:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait, then SIGKILL if it has not exited; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return int(self.process.returncode)


def launch_service(name: str, module: str, args: list[str], *, port: int, log: Path) -> Service:
    """`python -m MODULE ARGS` with its output in `log`; returns at once (see `wait_healthy`)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", module, *args], stdout=out, stderr=subprocess.STDOUT, env=env)
    return Service(name=name, url=f"http://127.0.0.1:{port}", process=process, log=log)


def wait_healthy(*services: Service, timeout_s: float = 300.0) -> None:
    """Return once every service answers GET /health with 200; stop them all and raise otherwise."""
    deadline = time.monotonic() + timeout_s
    pending = list(services)
    while pending and time.monotonic() < deadline:
        for service in list(pending):
            if service.process.poll() is not None:
                for other in services:
                    other.stop()
                raise RuntimeError(f"{service.name} exited with {service.process.returncode}; last log lines:\n"
                                   f"{_tail(service.log)}")
            try:
                if httpx.get(f"{service.url}/health", timeout=2.0).status_code == 200:
                    pending.remove(service)
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    if pending:
        for other in services:
            other.stop()
        raise RuntimeError(f"{pending[0].name} did not become healthy within {timeout_s:.0f}s; last log lines:\n"
                           f"{_tail(pending[0].log)}")


def _tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.is_file() else "(no log)"


def launch_retriever(*, index_dir: Path, corpus: Path, encoder: str, log: Path, port: int | None = None) -> Service:
    """`sisrl-retriever serve`; builds an exact index from `corpus` first when `index_dir` holds none."""
    port = port or free_port()
    args = ["serve", "--index", str(index_dir), "--corpus", str(corpus), "--encoder", encoder,
            "--port", str(port), "--log-level", "warning"]
    return launch_service("retriever", "sisrl.retriever.cli", args, port=port, log=log)


def launch_gateway(*, model: str, retriever_url: str, db: Path, checkpoint_root: Path, log: Path,
                  port: int | None = None, extra: list[str] | None = None, script: Path | None = None) -> Service:
    """`sisrl-gateway serve --engine local` (or `--engine scripted --script SCRIPT`, the tokenizer from `model`);
    POST /v1/policy accepts directories under `checkpoint_root`."""
    port = port or free_port()
    engine = ["--engine", "local"] if script is None else ["--engine", "scripted", "--script", str(script)]
    args = ["serve", *engine, "--model", model, "--retriever-url", retriever_url,
            "--db-url", f"sqlite:///{db}", "--checkpoint-root", str(checkpoint_root), "--port", str(port),
            "--log-level", "warning", *(extra or [])]
    return launch_service("gateway", "sisrl.services.cli", args, port=port, log=log)
