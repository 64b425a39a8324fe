"""`python -m sisrl.services.engines.openai_server`: flags from the ServerSettings fields, then serve."""

from __future__ import annotations

import argparse
import dataclasses
import os

import uvicorn
from pydantic import SecretStr
from sisrl.common.http import configure_logging
from sisrl.services.engines.openai_server.app import create_app
from sisrl.services.engines.openai_server.settings import TOKEN_ENV, ServerSettings


def parse_args(argv: list[str] | None = None) -> ServerSettings:
    """CLI flags from the ServerSettings fields (`--help` lists each with its default)."""
    parser = argparse.ArgumentParser(
        prog="python -m sisrl.services.engines.openai_server",
        description="OpenAI-completions-compatible policy server over the local transformers engine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in dataclasses.fields(ServerSettings):
        if f.name == "api_token":
            continue
        kind = int if f.type in ("int", int) else str
        parser.add_argument(
            f"--{f.name.replace('_', '-')}", type=kind, default=f.default, help=f.metadata["help"]
        )
    args = vars(parser.parse_args(argv))
    try:
        token = os.environ.get(TOKEN_ENV)
        return ServerSettings(**args, api_token=SecretStr(token) if token else None)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv)
    configure_logging(settings.log_level)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_config=None,
                log_level=settings.log_level)
