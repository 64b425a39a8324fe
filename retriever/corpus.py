"""Read a passage corpus: JSONL (optionally gzip) of `{"id": str, "contents": "\\"Title\\"\\ntext"}`.

The format is Search-R1's / FlashRAG's wiki-18 (docs/design.md, "Retrieval"). A bad line stops the read with
its line number, or is skipped and counted when `skip_bad` is set.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, cast

logger = logging.getLogger(__name__)


class CorpusError(ValueError):
    """A corpus line that is not a passage; the message names the file and line number."""


@dataclass(frozen=True)
class Passage:
    id: str
    contents: str


@dataclass
class ReadStats:
    """Filled while a corpus is read: lines seen, passages kept, bad lines skipped, sha256 of the raw bytes."""

    lines: int = 0
    passages: int = 0
    skipped: int = 0
    skipped_examples: list[str] = field(default_factory=list)
    sha256: str = ""
    bytes_read: int = 0


def parse_line(raw: bytes, *, where: str) -> Passage:
    """Parse one JSONL line into a Passage; raise CorpusError naming `where` (file:line) when it is not one."""
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorpusError(f"{where}: not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc})") from exc
    if not isinstance(obj, dict):
        raise CorpusError(f"{where}: expected a JSON object with 'id' and 'contents', got {type(obj).__name__}")
    missing = [key for key in ("id", "contents") if key not in obj]
    if missing:
        raise CorpusError(f"{where}: missing key(s) {missing}; a passage needs 'id' and 'contents'")
    pid, contents = obj["id"], obj["contents"]
    if not isinstance(pid, (str, int)) or isinstance(pid, bool):
        raise CorpusError(f"{where}: 'id' must be a string or integer, got {pid!r}")
    if not isinstance(contents, str):
        raise CorpusError(f"{where}: 'contents' must be a string, got {type(contents).__name__}")
    return Passage(id=str(pid), contents=contents)


def iter_passages(path: Path, *, skip_bad: bool = False, stats: ReadStats | None = None) -> Iterator[Passage]:
    """Yield the passages of `path` in file order; blank lines are ignored.

    `stats`, when given, is updated as lines are read; `stats.sha256` is the digest of the raw (compressed, for
    `.gz`) file bytes and is final once the iterator is exhausted.
    """
    stats = stats if stats is not None else ReadStats()
    digest = hashlib.sha256()
    with path.open("rb") as raw_file:
        # Hash the bytes on disk, not the decompressed stream: the checksum then identifies the file itself.
        hasher = _HashingReader(raw_file, digest)
        source = cast(IO[bytes], hasher)
        stream = cast(IO[bytes], gzip.GzipFile(fileobj=source, mode="rb")) if path.suffix == ".gz" else source
        for line_no, raw in enumerate(stream, start=1):
            stats.lines = line_no
            if not raw.strip():
                continue
            try:
                passage = parse_line(raw, where=f"{path}:{line_no}")
            except CorpusError as exc:
                if not skip_bad:
                    raise
                stats.skipped += 1
                if len(stats.skipped_examples) < 5:
                    stats.skipped_examples.append(str(exc))
                logger.warning("skipping bad corpus line: %s", exc)
                continue
            stats.passages += 1
            yield passage
        # Drain what the line iterator did not pull (trailing bytes), so the digest covers the whole file.
        while hasher.read(1 << 20):
            pass
    stats.bytes_read = hasher.bytes_read
    stats.sha256 = digest.hexdigest()


class _HashingReader:
    """A binary file wrapper that feeds every byte read through a hash."""

    def __init__(self, inner: IO[bytes], digest: hashlib._Hash) -> None:
        self._inner = inner
        self._digest = digest
        self.bytes_read = 0

    def read(self, size: int = -1) -> bytes:
        data = self._inner.read(size)
        self._digest.update(data)
        self.bytes_read += len(data)
        return data

    def readline(self, size: int = -1) -> bytes:
        data = self._inner.readline(size)
        self._digest.update(data)
        self.bytes_read += len(data)
        return data

    def __iter__(self) -> Iterator[bytes]:
        while True:
            line = self.readline()
            if not line:
                return
            yield line

    def readable(self) -> bool:
        return True


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
