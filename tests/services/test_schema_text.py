"""Text a gateway stores must be storable in every backend: PostgreSQL refuses NUL in text, so the request
schema refuses it with a 422 naming the field (before this, a NUL question was a 500 on PostgreSQL only)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from sisrl.services.schemas import RolloutCreate

from tests.utils.pg_cluster import Cluster


def _body(**item: Any) -> dict[str, Any]:
    base = {"id": "q1", "question": "who wrote it", "golden_answers": ["Ann"], "data_source": "nq"}
    return {"run": "r", "step": 0, "policy_version": 0, "items": [{**base, **item}]}


@pytest.mark.parametrize(("where", "body"), [
    ("question", _body(question="who\x00 wrote it")),
    ("golden_answers", _body(golden_answers=["Ann", "A\x00nn"])),
    ("id", _body(id="q\x001")),
    ("run", {**_body(), "run": "r\x00"}),
    ("idempotency_key", {**_body(), "idempotency_key": "k\x00"}),
])
def test_nul_in_stored_text_is_refused_naming_the_field(where: str, body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as info:
        RolloutCreate.model_validate(body)
    assert any(where in map(str, err["loc"]) for err in info.value.errors()), info.value.errors()
    RolloutCreate.model_validate(_body(question="who wrote it? \t tabs and ünïcode are fine"))


def test_postgresql_refuses_nul_in_text(pg_cluster: Cluster) -> None:
    """Why the rule exists: the real server rejects it (SQLite would store it)."""
    import psycopg

    with psycopg.connect(host="127.0.0.1", port=pg_cluster.port, user="postgres", dbname="postgres") as conn:
        with pytest.raises(psycopg.DataError, match="NUL"):
            conn.execute("SELECT %s::text", ("a\x00b",))
