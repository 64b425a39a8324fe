"""Crash-safe file writes: write to a temporary name beside the target, fsync, then rename over it."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success it is renamed to `target`, on error removed.

    A reader never sees a half-written `target` (POSIX rename is atomic within one filesystem).
    """
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with tmp.open("rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_json(target: Path, obj: Any) -> None:
    """Write `obj` as indented JSON to `target` atomically."""
    with atomic_path(target) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
