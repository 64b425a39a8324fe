"""The app's lifespan on the real index (in-process ASGI client, real encoder and index)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sisrl.retriever.app import GIL_SWITCH_S, create_app
from sisrl.retriever.settings import Settings

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_server_runs_with_a_short_gil_switch_interval_and_gives_the_old_one_back(minilm_index: Path) -> None:
    before = sys.getswitchinterval()
    assert before > GIL_SWITCH_S  # Python's default, 5 ms
    with TestClient(create_app(Settings(index=minilm_index, coalesce_ms=0))) as client:
        assert client.post("/retrieve", json={"queries": ["jazz"], "topk": 1}).status_code == 200
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_S)
    assert sys.getswitchinterval() == before
