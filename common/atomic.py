"""Crash-safe, durable writes (docs/design.md, "Cross-cutting rules": write to a temp name, then rename): a reader
never sees a half-written file or directory, and an interrupted writer leaves only a dot-named temp sibling
(`TEMP_NAME`) that `sweep_temps` removes at the next start.

The order is PostgreSQL's (`durable_rename` in its `fd.c`): write the temp copy, fsync it, rename it onto the
target, fsync the directory that holds both names. Without the last fsync a power cut can undo the rename;
without the first the renamed file can come back empty. POSIX rename is atomic within one filesystem only, so
every temp name lies beside its target.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# `.NAME.tmp`, `.NAME.tmp-PID`, `.NAME.tmp-XXXXXXXX` (a temp copy being written), `.NAME.old-PID` (an old copy
# moved aside to be deleted) and `.NAME.XXXXXXXX` (tempfile.mkdtemp's suffix: temp directories of older sisrl).
TEMP_NAME = re.compile(r"^\..+\.(tmp(-[^/]+)?|old-[^/]+|[a-z0-9_]{8})$")


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory: a directory's fsync makes the names created, renamed or removed in it durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root`, each directory after its contents, `root` last."""
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(Path(folder, name))
        fsync_path(Path(folder))


@contextlib.contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success it is fsynced and renamed to `target` (and the rename
    fsynced), on error removed."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, target)
        fsync_path(target.parent)
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


def remove_dir(path: Path) -> None:
    """Delete the directory `path` so that it is never seen half-deleted: renamed aside (`.NAME.old-PID`) in one
    step, then removed; a kill during the removal leaves only the aside copy, which `sweep_temps` deletes."""
    aside = path.with_name(f".{path.name}.old-{os.getpid()}")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    fsync_path(path.parent)
    shutil.rmtree(aside)


def replace_dir(tmp: Path, target: Path) -> None:
    """Move the finished (already fsynced) directory `tmp` onto `target`, moving an older `target` aside first.

    The two renames are not one atomic step (POSIX cannot rename onto a non-empty directory), but `target` is
    the old complete copy, absent, or the new complete copy: never a partial one. Both renames are fsynced.
    """
    if target.exists():
        remove_dir(target)
    os.replace(tmp, target)
    fsync_path(target.parent)


@contextlib.contextmanager
def atomic_dir(target: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yield a fresh temporary directory beside `target`; on success its files are fsynced and it becomes `target`,
    on error it is removed.

    `overwrite=True` replaces an existing `target` (a policy snapshot rewritten). `overwrite=False` is for
    caches that several processes may fill at once: when `target` already exists (another process finished
    first), that copy is kept and the new one dropped.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        fsync_tree(tmp)
        if overwrite:
            replace_dir(tmp, target)
        else:
            try:
                os.replace(tmp, target)
                fsync_path(target.parent)
            except OSError:
                # A non-empty `target` exists: only ever a complete copy, since it too came in by rename.
                if not target.is_dir():
                    raise
                logger.info("%s was written concurrently; keeping that copy", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sweep_temps(*folders: Path) -> list[Path]:
    """Delete the temp entries (`TEMP_NAME`) that killed writers left directly in `folders`; one log line names
    them. Only for folders whose single writer is the caller, before it writes (a trainer's `checkpoints/` and
    `policy/` at start): in a cache that another process may be filling, its temp copy would go too."""
    stale = sorted(p for folder in folders if folder.is_dir() for p in folder.iterdir() if TEMP_NAME.match(p.name))
    for path in stale:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    for folder in {p.parent for p in stale}:
        fsync_path(folder)
    if stale:
        logger.info("removed %d temp entries that interrupted writes left: %s", len(stale),
                    ", ".join(str(p) for p in stale))
    return stale


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
