"""`python -m sisrl.services.engines.openai_server`: flags from the ServerSettings fields, then serve."""

from __future__ import annotations

import argparse
import logging
import os

import uvicorn
from pydantic import SecretStr
from sisrl.common.cli import add_options, field_options, given
from sisrl.common.http import configure_logging
from sisrl.common.procs import port_problem
from sisrl.common.secrets import open_bind_warning, read_secret_file
from sisrl.services.engines.openai_server.app import create_app
from sisrl.services.engines.openai_server.settings import TOKEN_ENV, ServerSettings


def parse_args(argv: list[str] | None = None) -> ServerSettings:
    """CLI flags from the ServerSettings fields (`--help` lists each with its default)."""
    parser = argparse.ArgumentParser(
        prog="python -m sisrl.services.engines.openai_server",
        description="OpenAI-completions-compatible policy server over the local transformers engine.",
    )
    options = field_options(ServerSettings, skip=("api_token",))  # the token comes from the env only
    add_options(parser, options)
    args = given(parser.parse_args(argv), options)
    try:
        token = os.environ.get(TOKEN_ENV) or None
        file = os.environ.get(f"{TOKEN_ENV}_FILE") or None
        if token is not None and file is not None:
            raise ValueError(f"{TOKEN_ENV}: set either it or {TOKEN_ENV}_FILE, not both")
        if file is not None:
            token = read_secret_file(file, f"{TOKEN_ENV}_FILE")
        settings = ServerSettings(**args, api_token=SecretStr(token) if token else None)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
    else:
        if (busy := port_problem(settings.host, settings.port)) is not None:
            parser.error(busy)  # before the policy loads
        return settings


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv)
    configure_logging(settings.log_level)
    if (open_bind := open_bind_warning("the policy server", settings.host, settings.port,
                                       token_set=settings.api_token is not None, env=TOKEN_ENV)) is not None:
        logging.getLogger("sisrl.services.engines.openai_server").warning(open_bind)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_config=None,
                log_level=settings.log_level)
