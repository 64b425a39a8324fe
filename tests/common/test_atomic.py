"""sisrl.common.atomic: a target is either the old complete copy or the new one, never a partial write."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sisrl.common.atomic import (
    atomic_dir,
    atomic_path,
    file_lock,
    replace_dir,
    sweep_temps,
    write_json,
    write_jsonl,
)

from tests.utils.fsync_spy import record_fsyncs


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


def test_atomic_path_fsyncs_the_file_before_the_rename_and_the_folder_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = record_fsyncs(monkeypatch)
    write_json(tmp_path / "x.json", {"a": 1})
    assert calls == [str(tmp_path / f".x.json.tmp-{os.getpid()}"), str(tmp_path)]


def test_atomic_dir_fsyncs_every_file_and_folder_then_the_rename(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = record_fsyncs(monkeypatch)
    out = tmp_path / "policy" / "v000001"
    with atomic_dir(out, overwrite=True) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a").write_text("a")
        (tmp / "b").write_text("b")
    t = str(tmp)
    assert sorted(calls[:4]) == sorted([f"{t}/sub/a", f"{t}/sub", f"{t}/b", t])
    assert calls.index(f"{t}/sub/a") < calls.index(f"{t}/sub") < calls.index(t) == 3  # contents before folder
    assert calls[4:] == [str(out.parent)]  # the rename
    assert sorted(p.name for p in out.iterdir()) == ["b", "sub"]


def test_replace_dir_moves_the_old_copy_aside_before_deleting_it(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    old, new = tmp_path / "step_000001", tmp_path / "new"
    for folder, text in ((old, "old"), (new, "new")):
        folder.mkdir()
        (folder / "f").write_text(text)
    seen: list[list[str]] = []
    real_rmtree = shutil.rmtree

    def watch(path: Path, *args: object, **kwargs: object) -> None:  # what a kill during the delete would leave
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        real_rmtree(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(shutil, "rmtree", watch)
    replace_dir(new, old)
    aside = f".step_000001.old-{os.getpid()}"
    assert seen[-1] == sorted([aside, "new"])  # never a half-deleted step_000001
    assert (old / "f").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]


def test_sweep_temps_removes_only_temp_names_with_one_log_line(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    ckpt, policy = tmp_path / "checkpoints", tmp_path / "policy"
    temps = [ckpt / ".step_000002.tmp", ckpt / ".step_000001.old-77", policy / ".v000003.tmp-k2j3h4x9",
             policy / ".v000002.abcd_123", policy / ".config.json.tmp-12"]  # .abcd_123: an older sisrl's mkdtemp
    kept = [ckpt / "step_000001", policy / "v000003", policy / ".gitkeep", policy / ".nfs0000000000001234"]
    for path in temps[:4] + kept[:2]:
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"x")
    for path in (temps[4], kept[2], kept[3]):
        path.write_text("x")
    with caplog.at_level(logging.INFO, logger="sisrl.common.atomic"):
        removed = sweep_temps(ckpt, policy, tmp_path / "absent")
    assert sorted(removed) == sorted(temps)
    assert all(not p.exists() for p in temps) and all(p.exists() for p in kept)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and all(str(p) in lines[0] for p in temps), lines
    caplog.clear()
    assert sweep_temps(ckpt, policy) == [] and not caplog.records  # nothing left: no line
