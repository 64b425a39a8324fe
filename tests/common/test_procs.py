"""sisrl.common.procs on a stdlib HTTP server: launch, wait healthy, environment overrides, stop, early exit."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sisrl.common.procs import free_port, launch, peak_rss_bytes, port_problem, run_group, wait_healthy

# Answers GET /health with 200 and GET /env/NAME with that variable (404 when unset).
SERVER = """
import http.server, os, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        name = self.path.removeprefix("/env/")
        value = "ok" if self.path == "/health" else os.environ.get(name)
        self.send_response(200 if value is not None else 404)
        self.end_headers()
        self.wfile.write((value or "").encode())
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_launch_wait_env_and_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SISRL_TEST_DROPPED", "secret")
    port = free_port()
    service = launch("stub", [sys.executable, "-c", SERVER, str(port)], url=f"http://127.0.0.1:{port}",
                     log=tmp_path / "logs" / "stub.log", env={"SISRL_TEST_SET": "1", "SISRL_TEST_DROPPED": None})
    try:
        wait_healthy(service, timeout_s=30)
        assert httpx.get(f"{service.url}/env/SISRL_TEST_SET").text == "1"
        assert httpx.get(f"{service.url}/env/HF_HUB_OFFLINE").text == "1"
        assert httpx.get(f"{service.url}/env/SISRL_TEST_DROPPED").status_code == 404
        assert os.environ["SISRL_TEST_DROPPED"] == "secret"  # the parent's environment is untouched
    finally:
        code = service.stop(timeout_s=10)
    assert code == -15  # ended by our SIGTERM, not by SIGKILL or on its own


def test_wait_healthy_reports_an_early_exit_with_the_log_tail(tmp_path: Path) -> None:
    service = launch("broken", [sys.executable, "-c", "import sys; print('bad option --x'); sys.exit(2)"],
                     url=f"http://127.0.0.1:{free_port()}", log=tmp_path / "broken.log")
    with pytest.raises(RuntimeError, match=r"broken exited with 2(.|\n)*bad option --x"):
        wait_healthy(service, timeout_s=30)


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="VmHWM needs Linux's /proc")
def test_a_child_reports_its_own_peak_not_its_parents() -> None:
    # The parent holds 400 MiB when it forks; the child's own peak is a bare interpreter's (~10-20 MiB). ru_maxrss
    # in the child carries the parent's peak over the fork: the measure the benches used before.
    ballast = bytearray(400 * 2**20)
    ballast[::4096] = b"x" * len(ballast[::4096])  # touch every page
    assert peak_rss_bytes() >= 400 * 2**20
    code = ("import json, resource; from sisrl.common.procs import peak_rss_bytes; "
            "print(json.dumps([peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]))")
    own, inherited = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                               text=True).stdout)
    del ballast
    assert own < 200 * 2**20, own
    assert inherited >= 400 * 2**20, "ru_maxrss no longer inherits the parent's peak: this test shows nothing"


def test_port_problem_names_a_busy_port_and_passes_a_free_one() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        busy = listener.getsockname()[1]
        problem = port_problem("127.0.0.1", busy)
        assert problem is not None and problem.startswith(f"--port: cannot listen on 127.0.0.1:{busy} (")
    assert port_problem("127.0.0.1", busy) is None  # closed again: free
    assert port_problem("127.0.0.1", free_port()) is None and port_problem("127.0.0.1", 0) is None


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("leader_waits", [True, False], ids=["timed-out", "exited"])
def test_run_group_leaves_no_child_behind(tmp_path: Path, leader_waits: bool) -> None:
    """A launcher's child (as torchrun's ranks are) is killed with the group: when the run times out, and when
    the launcher exits first leaving it running."""
    pid_file = tmp_path / "child.pid"
    script = f"sleep 60 > /dev/null 2>&1 & echo $! > {pid_file}; " + ("wait" if leader_waits else "echo done")
    if leader_waits:
        with pytest.raises(subprocess.TimeoutExpired):
            run_group(["sh", "-c", script], timeout_s=1.0)
    else:
        done = run_group(["sh", "-c", script], timeout_s=30.0)
        assert (done.returncode, done.stdout.strip()) == (0, "done")
    child = int(pid_file.read_text())
    assert _wait_gone(child), f"the group's child {child} still runs"
