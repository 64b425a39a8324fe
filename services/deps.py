"""Dependencies of the route handlers, as Annotated aliases."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from pydantic import SecretStr
from sisrl.common.http import app_state, bearer_dependency
from sisrl.services.state import GatewayState
from sqlalchemy.orm import Session

get_state = app_state("gateway", GatewayState)


StateDep = Annotated[GatewayState, Depends(get_state)]


def get_session(state: StateDep) -> Iterator[Session]:
    with state.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def _api_token(request: Request) -> SecretStr | None:
    return get_state(request).settings.api_token


# 401 unless the request carries `Authorization: Bearer <api_token>` (no check when no token is set).
TokenDep = Depends(bearer_dependency(_api_token))
