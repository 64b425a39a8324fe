"""The app's lifespan on the real index (in-process ASGI client, real encoder and index)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sisrl.retriever.app import create_app
from sisrl.retriever.settings import Settings

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("gil_switch_ms", [None, 2.0])
def test_the_server_runs_with_its_gil_switch_interval_and_gives_the_old_one_back(minilm_index: Path,
                                                                                 gil_switch_ms: float | None) -> None:
    before = sys.getswitchinterval()  # Python's default is 5 ms
    expected = (gil_switch_ms or 0.5) / 1000  # 0.5 ms by default
    assert before != pytest.approx(expected)
    settings = Settings(index=minilm_index, coalesce_ms=0,
                        **({"gil_switch_ms": gil_switch_ms} if gil_switch_ms is not None else {}))
    with TestClient(create_app(settings)) as client:
        assert client.post("/retrieve", json={"queries": ["jazz"], "topk": 1}).status_code == 200
        assert sys.getswitchinterval() == pytest.approx(expected)
    assert sys.getswitchinterval() == before
