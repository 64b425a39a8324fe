"""`schemathesis run --checks all` over the live gateway's OpenAPI document, as it starts by default (no token)
and with a token: zero 5xx, answers and statuses as documented, security only when a token is set, 405s that
name every method. Bounded examples keep it short; the gateway's small max_pending and max_response_tokens
bound the rollouts that valid random bodies start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import run_schemathesis

EXAMPLES = 10


@pytest.fixture(scope="module")
def open_gateway(start_gateway: Any, tiny_policy_dir: Path, retriever_url: str) -> Any:
    """The gateway as it starts by default: no token."""
    return start_gateway("--engine", "local", "--model", str(tiny_policy_dir), "--retriever-url", retriever_url,
                         "--max-pending", "8", "--max-response-tokens", "128", "--max-request-bytes", "65536")


# A body the schema accepts but the gateway cannot run is a status the route lists: 400 (item ids that repeat, SIS
# arrays of unequal length, a checkpoint path the OS cannot open) or 413 (items x samples_per_item over this
# gateway's max_pending: a product of two fields). positive_data_acceptance allows those (never 422: the request
# models are strict, so what validates is what the schema says, and negative_data_rejection holds).
GATEWAY_ACCEPTS = ("400", "413")
# The stateful phase streams real batches to their end and the coverage phase starts hundreds of real rollouts;
# on two cores either passes the per-test budget, so the gateway runs the fuzzing phase (the retriever runs all).
PHASES = "examples,fuzzing"


def test_all_checks_pass_without_a_token(open_gateway: Any) -> None:
    schema = httpx.get(f"{open_gateway.url}/openapi.json").json()
    assert not any("security" in op for item in schema["paths"].values() for op in item.values())
    run_schemathesis(f"{open_gateway.url}/openapi.json", examples=EXAMPLES, also_accept=GATEWAY_ACCEPTS,
                     phases=PHASES)


def test_all_checks_pass_with_a_token(local_gateway: Any, gateway_token: str) -> None:
    schema = httpx.get(f"{local_gateway.url}/openapi.json").json()
    assert schema["paths"]["/v1/rollouts"]["post"]["security"]
    run_schemathesis(f"{local_gateway.url}/openapi.json", token=gateway_token, examples=EXAMPLES,
                     also_accept=GATEWAY_ACCEPTS, phases=PHASES)
