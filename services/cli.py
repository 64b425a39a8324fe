"""`sisrl-gateway serve`: run the rollout gateway (options mirror GatewaySettings; env vars fill the rest).

Secrets come from their env vars or `--*-file` options (sisrl.common.secrets): `--api-token` and
`--engine-api-key` still work but warn, and the retriever token has no flag at all."""

from __future__ import annotations

import argparse
import logging
import sys

from pydantic import ValidationError
from sisrl.common.cli import Option, add_options, field_options, flag_problems, given
from sisrl.common.procs import port_problem
from sisrl.common.secrets import command_line_warnings, open_bind_warning
from sisrl.services.retrieval_client import ROUTE
from sisrl.services.settings import ENV_ONLY, ENV_PREFIX, SECRETS, GatewaySettings

_ALIASES = {"retriever_url": ("--retriever",), "db_url": ("--db",)}  # short flags of the documented command
log = logging.getLogger("sisrl.services.cli")


def _options() -> list[Option]:
    return field_options(GatewaySettings, aliases=_ALIASES, skip=ENV_ONLY)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sisrl-gateway", description="sisrl rollout gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the gateway API (see docs/gateway.md)",
                           description="Serve the rollout gateway. Every option can also be set by its env var; "
                                       f"the retriever's token only by {SECRETS['retriever_token']} (or _FILE).")
    add_options(serve, _options(), env_prefix=ENV_PREFIX)
    return parser


def settings_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> GatewaySettings:
    try:
        return GatewaySettings(**given(args, _options()))
    except ValidationError as exc:
        parser.error(flag_problems(exc))


def _refuse_env_only_flags(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """A flag for an env-only secret is refused by name (argparse would take `--retriever-token` as an abbreviation
    of `--retriever-token-file` and read the token as a path)."""
    for name in ENV_ONLY:
        flag = "--" + name.replace("_", "-")
        if any(arg == flag or arg.startswith(flag + "=") for arg in argv):
            parser.error(f"{flag}: a secret is not taken on the command line, where every local user can read it "
                         f"(ps); set {SECRETS[name]}, or give {flag}-file FILE")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    _refuse_env_only_flags(parser, sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    settings = settings_from_args(args, parser)
    if (busy := port_problem(settings.host, settings.port)) is not None:
        parser.error(busy)  # before the policy loads
    import uvicorn
    from sisrl.common.http import configure_logging
    from sisrl.services.app import create_app

    configure_logging(settings.log_level)
    for warning in command_line_warnings(given(args, _options()), SECRETS):
        log.warning(warning)
    if (open_bind := open_bind_warning("the gateway", settings.host, settings.port,
                                       token_set=settings.api_token is not None,
                                       env=SECRETS["api_token"])) is not None:
        log.warning(open_bind)
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
