"""Dependencies of the route handlers, as Annotated aliases."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, cast

from fastapi import Depends, HTTPException, Request, status
from pydantic import SecretStr
from sisrl.common.http import app_state, bearer_dependency
from sisrl.services.state import GatewayState, Live
from sqlalchemy.orm import Session

get_state = app_state("gateway", GatewayState)


StateDep = Annotated[GatewayState, Depends(get_state)]


STORE_ONLY = ("the gateway runs store-only (sisrl-gateway serve --store-only): it serves stored rollouts, SIS "
              "records and the viewer, but has no engine to generate rollouts or load a policy; start it without "
              "--store-only for that")
# The OpenAPI entry of the 503 above, on every route that needs the engine.
STORE_ONLY_RESPONSE = {503: {"description": "the gateway runs store-only: no engine"}}


async def get_live(state: StateDep) -> Live:
    if state.live is None:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, detail=STORE_ONLY)
    return state.live


LiveDep = Annotated[Live, Depends(get_live)]


def get_session(state: StateDep) -> Iterator[Session]:
    with state.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def _api_token(request: Request) -> SecretStr | None:
    return cast(GatewayState, request.app.state.gateway).settings.api_token


# 401 unless the request carries `Authorization: Bearer <api_token>` (no check when no token is set).
TokenDep = Depends(bearer_dependency(_api_token))
