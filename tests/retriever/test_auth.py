"""The optional bearer token, on the real app (in-process ASGI client, real encoder and index), and where a token
may come from: its env var or a file, never shorter than 16 characters (sisrl.common.secrets)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sisrl.retriever.app import create_app
from sisrl.retriever.cli import main
from sisrl.retriever.settings import Settings

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TOKEN = "s3cret-s3cret-16"


@pytest.fixture(scope="module")
def client(minilm_index: Path) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(index=minilm_index, api_token=TOKEN, coalesce_ms=0))) as test_client:
        yield test_client


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}])
@pytest.mark.parametrize("method,path", [("post", "/retrieve"), ("get", "/metrics")])
def test_protected_routes_refuse_a_missing_or_wrong_token(client: TestClient, headers: dict[str, str],
                                                          method: str, path: str) -> None:
    response = client.request(method, path, headers=headers, json={"queries": ["jazz"]})
    assert response.status_code == 401 and "bearer token" in response.json()["detail"]
    assert response.headers["www-authenticate"] == "Bearer"


def test_the_right_token_is_accepted_and_health_stays_open(client: TestClient) -> None:
    good = {"Authorization": f"Bearer {TOKEN}"}
    response = client.post("/retrieve", headers=good, json={"queries": ["jazz"], "topk": 1})
    assert response.status_code == 200 and response.json()["result"][0][0]["id"] == "doc5"
    assert client.get("/metrics", headers=good).status_code == 200
    assert client.get("/health").status_code == 200  # the Docker healthcheck carries no token


def test_empty_token_setting_means_no_token() -> None:
    assert Settings(index=Path("."), api_token="").api_token is None


def test_a_short_token_is_refused_in_one_line_naming_the_setting_and_never_showing_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SISRL_RETRIEVER_API_TOKEN", "s3cret")
    with pytest.raises(SystemExit) as info:
        main(["serve", "--index", "."])
    error = capsys.readouterr().err
    assert info.value.code == 2 and error.count("\n") == 1, error
    assert error.startswith("sisrl-retriever serve: error: --api-token: expected at least 16 characters, got 6 "
                            "(set SISRL_RETRIEVER_API_TOKEN to a longer secret"), error
    assert "s3cret" not in error


def test_the_token_is_read_from_the_env_or_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SISRL_RETRIEVER_API_TOKEN", TOKEN)
    assert Settings(index=Path(".")).api_token.get_secret_value() == TOKEN  # type: ignore[union-attr]
    monkeypatch.delenv("SISRL_RETRIEVER_API_TOKEN")
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")  # as `echo` writes it: the newline is no part of the token
    monkeypatch.setenv("SISRL_RETRIEVER_API_TOKEN_FILE", str(secret))
    assert Settings(index=Path(".")).api_token.get_secret_value() == TOKEN  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="set either it or api_token_file, not both"):
        Settings(index=Path("."), api_token=TOKEN)
    monkeypatch.setenv("SISRL_RETRIEVER_API_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="api_token_file: cannot read .*missing"):
        Settings(index=Path("."))
    monkeypatch.setenv("SISRL_RETRIEVER_API_TOKEN_FILE", "")  # docker compose's unset variable
    assert Settings(index=Path(".")).api_token is None
