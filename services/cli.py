"""`sisrl-gateway serve`: run the rollout gateway (options mirror GatewaySettings; env vars fill the rest)."""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError
from sisrl.common.cli import add_options, field_options, flag_problems, given
from sisrl.common.procs import port_problem
from sisrl.services.retrieval_client import ROUTE
from sisrl.services.settings import GatewaySettings

_ALIASES = {"retriever_url": ("--retriever",), "db_url": ("--db",)}  # short flags of the documented command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sisrl-gateway", description="sisrl rollout gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the gateway API (see docs/gateway.md)",
                           description="Serve the rollout gateway. Every option can also be set by its env var.")
    add_options(serve, field_options(GatewaySettings, aliases=_ALIASES), env_prefix="SISRL_GATEWAY_")
    return parser


def settings_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> GatewaySettings:
    try:
        return GatewaySettings(**given(args, field_options(GatewaySettings)))
    except ValidationError as exc:
        parser.error(flag_problems(exc))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    settings = settings_from_args(args, parser)
    if (busy := port_problem(settings.host, settings.port)) is not None:
        parser.error(busy)  # before the policy loads
    import uvicorn
    from sisrl.common.http import configure_logging
    from sisrl.services.app import create_app

    configure_logging(settings.log_level)
    base = f"http://{settings.host}:{settings.port}"
    # The retriever as it will be posted to: a URL given as base or as /retrieve endpoint shows the same here.
    retrievers = ", ".join(url + ROUTE for url in settings.retriever_urls)
    mode = "store-only: no engine" if settings.store_only else f"engine {settings.engine}; retriever {retrievers}"
    print(f"sisrl-gateway: serving on {base} ({mode}); viewer at {base}/ui", file=sys.stderr)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_config=None,
                log_level=settings.log_level, timeout_graceful_shutdown=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
