"""Property-based run over the live gateway's OpenAPI schema (with the bearer token): zero 5xx, and answers
match their documented schemas. Bounded examples keep it short; the gateway's small max_pending and
max_response_tokens bound the rollouts that valid random bodies start.

The operations are driven with plain Hypothesis (`operation.as_strategy()`): schemathesis' pytest fixture
loader relies on a pytest-internal attribute that pytest 9 removed."""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance

EXAMPLES = 25


def test_no_server_errors(local_gateway: Any, gateway_token: str) -> None:
    schema = schemathesis.openapi.from_url(f"{local_gateway.url}/openapi.json")
    headers = {"Authorization": f"Bearer {gateway_token}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 10

    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        def check(case: schemathesis.Case) -> None:
            case.call_and_validate(headers=headers, checks=[not_a_server_error, response_schema_conformance],
                                   timeout=60)

        check()
