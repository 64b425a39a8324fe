"""The document store of an index: passages on disk, looked up by row without loading the corpus into RAM.

Layout: `docs.jsonl` holds one compact `{"id", "contents"}` object per line, in index row order, and
`offsets.int64` holds n + 1 little-endian byte offsets into it (row i spans offsets[i]:offsets[i + 1]). The
offsets are memory-mapped and rows are read with `os.pread`, so serving wiki-18 (21 M passages, ~13 GB) costs
8 bytes per passage of address space and only the pages actually read; `pread` is safe across threads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from sisrl.retriever.corpus import Passage, parse_line
from sisrl.retriever.manifest import DOCS_FILE

OFFSETS_FILE = "offsets.int64"


class DocStoreWriter:
    """Append passages to `docs.jsonl` + `offsets.int64` under temporary names; `commit()` renames both."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._docs_tmp = directory / f".{DOCS_FILE}.partial"
        self._offsets_tmp = directory / f".{OFFSETS_FILE}.partial"
        self._docs = self._docs_tmp.open("wb")
        self._offsets = self._offsets_tmp.open("wb")
        self._position = 0
        self.count = 0
        self._offsets.write(np.int64(0).tobytes())

    def add(self, passage: Passage) -> None:
        line = json.dumps({"id": passage.id, "contents": passage.contents}, ensure_ascii=False).encode() + b"\n"
        self._docs.write(line)
        self._position += len(line)
        self._offsets.write(np.int64(self._position).tobytes())
        self.count += 1

    def commit(self) -> None:
        for handle in (self._docs, self._offsets):
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
        os.replace(self._docs_tmp, self._dir / DOCS_FILE)
        os.replace(self._offsets_tmp, self._dir / OFFSETS_FILE)

    def abort(self) -> None:
        for handle in (self._docs, self._offsets):
            handle.close()
        for tmp in (self._docs_tmp, self._offsets_tmp):
            tmp.unlink(missing_ok=True)


class DocStore:
    """Read-only row -> Passage lookup over a committed store.

    `docs`: the JSONL file the offsets point into, when it is not the store's own `docs.jsonl` (an imported
    index reads its corpus in place, retriever/prebuilt.py); its lines are then checked as they are read.
    """

    def __init__(self, directory: Path, docs: Path | None = None) -> None:
        docs_path, offsets_path = docs or directory / DOCS_FILE, directory / OFFSETS_FILE
        for path in (docs_path, offsets_path):
            if not path.is_file():
                raise FileNotFoundError(f"document store file {str(path)!r} is missing")
        self._offsets = np.memmap(offsets_path, dtype="<i8", mode="r")
        if self._offsets.shape[0] < 1:
            raise ValueError(f"{offsets_path}: empty offsets file, expected n + 1 int64 offsets")
        size = docs_path.stat().st_size
        if int(self._offsets[-1]) != size:
            raise ValueError(
                f"{docs_path}: is {size} bytes but {offsets_path.name} ends at {int(self._offsets[-1])}; "
                "the store is truncated or from another build"
            )
        self._fd = os.open(docs_path, os.O_RDONLY)
        self._where = str(docs_path)  # named in a bad line's error

    def __len__(self) -> int:
        return int(self._offsets.shape[0]) - 1

    def get(self, row: int) -> Passage:
        if not 0 <= row < len(self):
            raise IndexError(f"row {row} outside the store's 0..{len(self) - 1}")
        start, end = int(self._offsets[row]), int(self._offsets[row + 1])
        return parse_line(os.pread(self._fd, end - start, start), where=f"{self._where}: row {row}")

    def iter_range(self, start: int, stop: int) -> Iterable[Passage]:
        """Rows start..stop-1 read in one sequential pass (for encoding shards)."""
        begin, end = int(self._offsets[start]), int(self._offsets[stop])
        blob = os.pread(self._fd, end - begin, begin)
        for row, line in enumerate(blob.splitlines(), start=start):
            yield parse_line(line, where=f"{self._where}: row {row}")

    def close(self) -> None:
        os.close(self._fd)
