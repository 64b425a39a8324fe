"""Fixtures shared by every test package."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """`../shared/data` beside the clone (NQ, HotpotQA, a Wikipedia passage corpus); skip when absent."""
    if not (SHARED_DATA / "corpus" / "wiki_passages.jsonl").is_file():
        pytest.skip(f"shared data not found at {SHARED_DATA} (a clone outside this workplace)")
    return SHARED_DATA
