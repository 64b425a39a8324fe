"""sisrl.common.atomic: a target is either the old complete copy or the new one, never a partial write."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sisrl.common.atomic import atomic_dir, atomic_path, file_lock, replace_dir, write_json, write_jsonl


def test_atomic_path_error_keeps_old_target_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "a.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_write_json_and_jsonl_round_trip(tmp_path: Path) -> None:
    write_json(tmp_path / "sub" / "x.json", {"b": 1, "a": "é"})
    assert json.loads((tmp_path / "sub" / "x.json").read_text(encoding="utf-8")) == {"a": "é", "b": 1}
    write_jsonl(tmp_path / "rows.jsonl", iter([{"q": "é"}, {"q": 2}]))
    lines = (tmp_path / "rows.jsonl").read_text(encoding="utf-8").splitlines()
    assert lines == ['{"q": "é"}', '{"q": 2}']


def test_atomic_dir_overwrite_replaces_and_error_keeps_old(tmp_path: Path) -> None:
    out = tmp_path / "policy"
    with atomic_dir(out, overwrite=True) as tmp:
        (tmp / "v").write_text("1")
    with pytest.raises(RuntimeError), atomic_dir(out, overwrite=True) as tmp:
        (tmp / "v").write_text("half")
        raise RuntimeError("interrupted")
    assert (out / "v").read_text() == "1"
    with atomic_dir(out, overwrite=True) as tmp:
        (tmp / "w").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == ["w"]  # the old copy is gone, not merged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]


def test_atomic_dir_without_overwrite_keeps_the_copy_that_finished_first(tmp_path: Path) -> None:
    out = tmp_path / "model"
    with atomic_dir(out, overwrite=False) as tmp:
        (tmp / "v").write_text("first")
        other = tmp_path / "other"
        other.mkdir()
        (other / "v").write_text("concurrent")
        replace_dir(other, out)  # a second process renames its complete copy in first
    assert (out / "v").read_text() == "concurrent"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_file_lock_makes_a_second_process_wait(tmp_path: Path) -> None:
    lock = tmp_path / "deep" / "x.lock"
    waiter = ("import sys, time; from pathlib import Path; from sisrl.common.atomic import file_lock\n"
              "with file_lock(Path(sys.argv[1])): print(time.time())")
    with file_lock(lock):
        other = subprocess.Popen([sys.executable, "-c", waiter, str(lock)], stdout=subprocess.PIPE, text=True)
        time.sleep(1.0)
        assert other.poll() is None, "the second process got the lock while this one held it"
        released = time.time()
    out, _ = other.communicate(timeout=60)
    assert other.returncode == 0 and float(out) >= released
