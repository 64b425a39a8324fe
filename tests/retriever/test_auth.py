"""The optional bearer token, on the real app (in-process ASGI client, real encoder and index)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sisrl.retriever.app import create_app
from sisrl.retriever.settings import Settings

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def client(minilm_index: Path) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(index=minilm_index, api_token="s3cret", coalesce_ms=0))) as test_client:
        yield test_client


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}])
@pytest.mark.parametrize("method,path", [("post", "/retrieve"), ("get", "/metrics")])
def test_protected_routes_refuse_a_missing_or_wrong_token(client: TestClient, headers: dict[str, str],
                                                          method: str, path: str) -> None:
    response = client.request(method, path, headers=headers, json={"queries": ["jazz"]})
    assert response.status_code == 401 and "bearer token" in response.json()["detail"]
    assert response.headers["www-authenticate"] == "Bearer"


def test_the_right_token_is_accepted_and_health_stays_open(client: TestClient) -> None:
    good = {"Authorization": "Bearer s3cret"}
    response = client.post("/retrieve", headers=good, json={"queries": ["jazz"], "topk": 1})
    assert response.status_code == 200 and response.json()["result"][0][0]["id"] == "doc5"
    assert client.get("/metrics", headers=good).status_code == 200
    assert client.get("/health").status_code == 200  # the Docker healthcheck carries no token


def test_empty_token_setting_means_no_token() -> None:
    assert Settings(index=Path("."), api_token="").api_token is None
