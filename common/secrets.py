"""Secrets of the three services (bearer tokens, API keys): where they may come from, how long they must be, and
what to warn about at start (docs/design.md, "Cross-cutting requirements").

- A secret comes from its environment variable (`SISRL_<PART>_<NAME>`) or from a file named by the `<name>_file`
  setting (`SISRL_<PART>_<NAME>_FILE`, e.g. a Docker or Kubernetes secret mounted at /run/secrets/...): a file's
  path is no secret, its content is. A secret given as a command-line flag is visible to every local user in the
  process list (`ps`, /proc/<pid>/cmdline); the flags that still accept one warn, naming the variable to use.
- A token has at least MIN_TOKEN_CHARS characters: a short one is refused at start, naming the setting.
- A server that binds a non-loopback address with no token serves anyone who can reach its port: it warns.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import SecretStr

MIN_TOKEN_CHARS = 16
LOOPBACK_NAMES = ("localhost",)


def read_secret_file(path: Path | str, setting: str) -> str:
    """The secret in `path`, without its trailing newline or spaces (as `echo token > file` writes it);
    ValueError naming `setting` (the option or variable that named the file) when it cannot be read or is empty."""
    try:
        value = Path(path).expanduser().read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{setting}: cannot read {str(path)!r} ({getattr(exc, 'strerror', None) or exc})") \
            from None
    if not value:
        raise ValueError(f"{setting}: {str(path)!r} is empty")
    return value


def secrets_from_files(values: Any, names: Iterable[str]) -> Any:
    """`values` (a settings model's raw input) with each secret `name` read from the file that `<name>_file`
    names, when that is set. Both set is refused: which of the two wins would be a guess."""
    if not isinstance(values, Mapping):
        return values
    out = dict(values)
    for name in names:
        path = out.get(f"{name}_file")
        if path in (None, ""):
            if path == "":  # docker compose passes an unset variable as "": no file
                out[f"{name}_file"] = None
            continue
        if out.get(name) not in (None, ""):
            raise ValueError(f"{name}: set either it or {name}_file, not both")
        out[name] = read_secret_file(path, f"{name}_file")
    return out


def check_token(token: SecretStr | None, setting: str, env: str) -> None:
    """ValueError `<setting>: ...` (a one-line CLI error, sisrl.common.cli.flag_problems) for a token shorter than
    MIN_TOKEN_CHARS; the value itself is never shown."""
    if token is not None and len(token.get_secret_value()) < MIN_TOKEN_CHARS:
        raise ValueError(f"{setting}: expected at least {MIN_TOKEN_CHARS} characters, got "
                         f"{len(token.get_secret_value())} (set {env} to a longer secret, e.g. the output of "
                         f"`python -c 'import secrets; print(secrets.token_urlsafe(24))'`)")


def command_line_warnings(given: Iterable[str], secrets: Mapping[str, str]) -> list[str]:
    """One warning per secret setting in `given` (the settings set by command-line flags); `secrets` maps each
    secret setting to its environment variable."""
    return [f"--{name.replace('_', '-')} puts a secret in the process list (ps, /proc/<pid>/cmdline); set "
            f"{secrets[name]} (or {secrets[name]}_FILE, a file holding it) instead"
            for name in given if name in secrets]


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`; False for any other address or name (0.0.0.0 included)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def open_bind_warning(service: str, host: str, port: int, *, token_set: bool, env: str) -> str | None:
    """The warning for a server that binds `host` beyond loopback with no token, or None."""
    if token_set or is_loopback(host):
        return None
    return (f"{service} listens on {host}:{port}, beyond loopback, with no token: anyone who can reach that port "
            f"can use it; set {env} (or {env}_FILE), or bind 127.0.0.1")
