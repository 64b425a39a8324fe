"""Where secrets may come from and what is warned about (sisrl.common.secrets), on the gateway's real settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError
from sisrl.common.secrets import check_token, command_line_warnings, is_loopback, open_bind_warning
from sisrl.services.settings import GatewaySettings
from sisrl.services.store import display_url

TOKEN = "0123456789abcdef"  # exactly the 16-character minimum


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("127.3.2.1", True), ("::1", True),
                                                ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                                ("::", False), ("10.0.0.5", False), ("example.org", False)])
def test_only_loopback_addresses_count_as_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_an_open_bind_warns_only_beyond_loopback_and_without_a_token() -> None:
    warning = open_bind_warning("the gateway", "0.0.0.0", 8100, token_set=False, env="SISRL_GATEWAY_API_TOKEN")
    assert warning is not None and "0.0.0.0:8100, beyond loopback, with no token" in warning
    assert "SISRL_GATEWAY_API_TOKEN" in warning
    assert open_bind_warning("x", "0.0.0.0", 1, token_set=True, env="E") is None
    assert open_bind_warning("x", "127.0.0.1", 1, token_set=False, env="E") is None


def test_the_minimum_is_16_characters_and_the_error_never_shows_the_token() -> None:
    check_token(SecretStr(TOKEN), "api_token", "E")
    check_token(None, "api_token", "E")
    with pytest.raises(ValueError, match=r"^api_token: expected at least 16 characters, got 15 \(set E ") as info:
        check_token(SecretStr(TOKEN[:-1]), "api_token", "E")
    assert TOKEN[:-1] not in str(info.value)


def test_command_line_secrets_are_named_with_their_variables() -> None:
    (warning,) = command_line_warnings(["port", "api_token"], {"api_token": "SISRL_X_API_TOKEN"})
    assert warning.startswith("--api-token puts a secret in the process list") and "SISRL_X_API_TOKEN_FILE" in warning


def test_gateway_secrets_come_from_their_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "gw").write_text(TOKEN + "\n")
    (tmp_path / "rt").write_text("retriever-" + TOKEN + "\n")
    monkeypatch.setenv("SISRL_GATEWAY_RETRIEVER_TOKEN_FILE", str(tmp_path / "rt"))
    settings = GatewaySettings(api_token_file=tmp_path / "gw")
    assert settings.api_token is not None and settings.api_token.get_secret_value() == TOKEN
    assert settings.retriever_token is not None and settings.retriever_token.get_secret_value() == "retriever-" + TOKEN
    with pytest.raises(ValidationError, match="api_token: set either it or api_token_file, not both"):
        GatewaySettings(api_token=TOKEN, api_token_file=tmp_path / "gw")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValidationError, match="retriever_token_file: .*empty' is empty"):
        GatewaySettings(retriever_token_file=tmp_path / "empty")


def test_a_gateway_token_shorter_than_16_characters_is_refused() -> None:
    with pytest.raises(ValidationError, match="api_token: expected at least 16 characters, got 8"):
        GatewaySettings(api_token="12345678")  # accepted before issue 43 (the minimum was 8)
    with pytest.raises(ValidationError, match="api_token: expected at least 16 characters, got 0"):
        GatewaySettings(api_token="")  # an empty token is no "no token" for the gateway: refused


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql+psycopg://sisrl:hunter2@db:5432/rollouts", "postgresql+psycopg://sisrl:***@db:5432/rollouts"),
    ("postgresql://sisrl@db/rollouts", "postgresql://sisrl@db/rollouts"),
    ("sqlite:///gateway.db", "sqlite:///gateway.db"),
    ("not a url hunter2", "(a database URL SQLAlchemy cannot parse; not shown)"),
])
def test_a_logged_database_url_hides_its_password(url: str, shown: str) -> None:
    assert display_url(url) == shown
