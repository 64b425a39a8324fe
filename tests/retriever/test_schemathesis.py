"""Property-based run over the live server's OpenAPI schema: no generated input may produce a 5xx, and every
answer must match the documented schema (a bounded number of examples keeps the suite short)."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance

from .conftest import Server

EXAMPLES_PER_OPERATION = 25


def test_no_server_errors_over_the_openapi_schema(minilm_server: Server) -> None:
    schema = schemathesis.openapi.from_url(f"{minilm_server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/retrieve", "/health", "/metrics"}
    calls: list[int] = []
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case: schemathesis.Case) -> None:
            response = case.call(timeout=60)
            calls.append(response.status_code)
            case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])

        run()
    assert len(calls) >= len(operations) and all(code < 500 for code in calls)
