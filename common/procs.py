"""Service processes on loopback: a free port, launch (argument list, never a shell), wait for health, stop.

The demo, the trainer's end-to-end runs, the test fixtures and the benchmarks all start the retriever, the
gateway or the policy server this way; output goes to a log file whose tail is quoted when a start fails.
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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

LOOPBACK = "127.0.0.1"


def peak_rss_bytes() -> int:
    """This process's peak RSS: VmHWM, which starts afresh at exec (ru_maxrss keeps the forking parent's peak,
    so a child of a large process would report the parent's size); ru_maxrss where /proc is missing."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free a moment ago (the OS picks it; a race with another binder is possible but rare)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_problem(host: str, port: int) -> str | None:
    """Why a server could not bind `host:port` now (one line), or None; checked before a model loads, so a busy
    port costs a second, not the load. Port 0 (the OS picks) always binds. SO_REUSEADDR as uvicorn sets it, so a
    port in TIME_WAIT counts as free, as it is for the server."""
    if port == 0:
        return None
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except (OSError, OverflowError) as exc:  # OverflowError: a port beyond 65535
        reason = getattr(exc, "strerror", None) or exc
        return f"--port: cannot listen on {host}:{port} ({reason}); stop what uses it or pick another port"
    return None


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


def stop_process(process: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
    """Send `sig` (SIGTERM: a clean shutdown), wait, then SIGKILL if it has not exited; returns the exit code."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return int(process.returncode)


def run_group(command: list[str], *, env: Mapping[str, str] | None = None, timeout_s: float,
              cwd: str | Path | None = None) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(command, capture_output=True, text=True)` in a process group of its own, which is killed
    whole when the run ends for any reason (its time out, an exception, pytest-timeout's interrupt). A launcher
    such as torchrun starts its ranks as its children: killing the launcher alone would leave them spinning in a
    collective, holding the cores, after the test that started them had failed. TimeoutExpired on timeout."""
    proc = subprocess.Popen(command, env=None if env is None else dict(env), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group id is the leader's pid, also after it exited
        if proc.returncode is None:
            proc.communicate()
    return subprocess.CompletedProcess(command, int(proc.returncode), out, err)


def log_tail(log: Path, lines: int = 30) -> str:
    """The last `lines` lines of a log file, for error messages."""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.is_file() else "(no log)"


@dataclass
class Service:
    """A started server process, its base URL and its log file."""

    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def stop(self, timeout_s: float = 30.0, sig: int = signal.SIGTERM) -> int:
        """Stop the process (`sig`, then SIGKILL after `timeout_s`); returns the exit code."""
        return stop_process(self.process, sig, timeout_s)


def launch(name: str, command: list[str], *, url: str, log: Path,
           env: Mapping[str, str | None] | None = None, cwd: Path | None = None) -> Service:
    """Start `command` with stdout and stderr in `log`, in `cwd` (None: this process's); returns at once (see
    `wait_healthy`).

    The child gets this environment with `HF_HUB_OFFLINE=1` and `env` applied on top (a None value removes
    that variable, e.g. a token the parent happens to have set).
    """
    merged = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for key, value in (env or {}).items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=merged, cwd=cwd)
    return Service(name=name, url=url, process=process, log=log)


def launch_module(name: str, module: str, args: list[str], *, port: int, log: Path,
                  env: Mapping[str, str | None] | None = None) -> Service:
    """`python -m MODULE ARGS` (this interpreter) serving on `http://127.0.0.1:PORT`; see `launch`."""
    return launch(name, [sys.executable, "-m", module, *args], url=f"http://{LOOPBACK}:{port}", log=log, env=env)


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
                                   f"{log_tail(service.log)}")
            try:
                if httpx.get(f"{service.url}/health", timeout=2.0).status_code == 200:
                    pending.remove(service)
            except httpx.TransportError:
                pass
        if pending:
            time.sleep(0.1)
    if pending:
        for other in services:
            other.stop()
        raise RuntimeError(f"{pending[0].name} did not become healthy within {timeout_s:.0f}s; last log lines:\n"
                           f"{log_tail(pending[0].log)}")
