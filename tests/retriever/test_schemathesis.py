"""`schemathesis run --checks all` over the live retriever's OpenAPI document, as it starts by default and with
a token: every check passes (no 5xx, responses and statuses as documented, security only when a token is set,
schema-valid requests accepted and schema-violating ones rejected)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.conftest import run_schemathesis

from .conftest import TOKEN, Server


def test_the_schema_is_true_without_a_token(minilm_server: Server) -> None:
    schema = httpx.get(f"{minilm_server.url}/openapi.json").json()
    assert "security" not in schema["paths"]["/retrieve"]["post"]
    assert "oneOf" in schema["components"]["schemas"]["RetrieveRequest"]
    run_schemathesis(f"{minilm_server.url}/openapi.json")


def test_the_schema_is_true_with_a_token(token_server: Server) -> None:
    schema = httpx.get(f"{token_server.url}/openapi.json").json()
    assert schema["paths"]["/retrieve"]["post"]["security"] and "401" in schema["paths"]["/retrieve"]["post"]["responses"]
    assert "security" not in schema["paths"]["/health"]["get"]  # the Docker healthcheck carries no token
    run_schemathesis(f"{token_server.url}/openapi.json", token=TOKEN)


def test_a_schema_that_lies_is_caught(minilm_server: Server, tmp_path: Path) -> None:
    """The check can fail: the served document with the exactly-one-of rule removed lets schemathesis send `{}`,
    which the server rightly answers 422 (ST202)."""
    schema = httpx.get(f"{minilm_server.url}/openapi.json").json()
    del schema["components"]["schemas"]["RetrieveRequest"]["oneOf"]
    lying = tmp_path / "openapi.json"
    lying.write_text(json.dumps(schema))
    with pytest.raises(pytest.fail.Exception, match="Schema-valid request rejected"):
        run_schemathesis(str(lying), base_url=minilm_server.url)
