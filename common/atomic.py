"""Crash-safe writes (docs/design.md, "Cross-cutting rules": write to a temp name, then rename): a reader never
sees a half-written file or directory, and an interrupted writer leaves only a dot-named temp sibling that the
next run replaces.

POSIX rename is atomic within one filesystem, so every temp name lies beside its target.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success it is fsynced and renamed to `target`, on error removed."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with tmp.open("rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text(target: Path, text: str) -> None:
    """Write `text` (UTF-8) to `target` atomically, creating its parent folder."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(target: Path, obj: Any) -> None:
    """Write `obj` as indented, key-sorted JSON to `target` atomically."""
    write_text(target, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_jsonl(target: Path, rows: Any) -> None:
    """Write an iterable of JSON-able rows, one per line (non-ASCII kept), to `target` atomically."""
    write_text(target, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def replace_dir(tmp: Path, target: Path) -> None:
    """Move the finished directory `tmp` onto `target`, removing an older `target` first.

    The two steps are not one atomic rename (POSIX cannot rename onto a non-empty directory), but `target`
    is either the old complete copy, absent, or the new complete copy: never a partial one.
    """
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)


@contextlib.contextmanager
def atomic_dir(target: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yield a fresh temporary directory beside `target`; on success it becomes `target`, on error it is removed.

    `overwrite=True` replaces an existing `target` (a policy snapshot rewritten). `overwrite=False` is for
    caches that several processes may fill at once: when `target` already exists (another process finished
    first), that copy is kept and the new one dropped.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
        if overwrite:
            replace_dir(tmp, target)
        else:
            try:
                os.replace(tmp, target)
            except OSError:
                # A non-empty `target` exists: only ever a complete copy, since it too came in by rename.
                if not target.is_dir():
                    raise
                logger.info("%s was written concurrently; keeping that copy", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (created if missing) for the block: processes that would fill the same
    cache entry at once (two servers exporting a model, two clones building a venv) do it one after the other."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
