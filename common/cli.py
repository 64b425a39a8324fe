"""One settings -> argparse generator: each field of a pydantic model or a dataclass becomes one flag.

The help text is the field's description (pydantic `Field(description=...)`, dataclass `metadata={"help": ...}`)
followed by its default (and env var, when the settings read one). Unset flags are left out of the namespace
(`argparse.SUPPRESS`), so the settings' own defaults and env vars fill them; `given` collects what was set.
Booleans are switches with a `--no-` form.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr, ValidationError

_SCALARS: dict[Any, type] = {int: int, float: float, str: str, Path: Path, bool: bool, SecretStr: str}


@dataclass(frozen=True)
class Option:
    """One flag: `--name-with-dashes`, its value type, default (shown in the help only) and help text."""

    name: str
    kind: Any
    default: Any
    help: str
    required: bool = False
    dest: str | None = None
    aliases: tuple[str, ...] = ()


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's `(default: X)` in each help line, but `(required)` for a required option, not `(default: None)`."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required and action.option_strings:
            return f"{action.help} (required)"
        return super()._get_help_string(action)


def arg_type(annotation: Any) -> type:
    """The argparse `type` of an annotation: `int | None` -> int, `Path` -> Path, `Literal[...]` -> str."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = options[0] if options else str
    return _SCALARS.get(annotation, str)


def field_options(cls: type, *, skip: Iterable[str] = (), aliases: Mapping[str, tuple[str, ...]] | None = None,
                  names: Mapping[str, str] | None = None, dest_prefix: str = "") -> list[Option]:
    """Options for every field of `cls` (a pydantic model or a dataclass) but `skip`; `names` renames a flag
    (field -> flag name), `dest_prefix` prefixes every destination (several configs in one namespace)."""
    skipped, aliases, names = set(skip), aliases or {}, names or {}
    rows: list[tuple[str, Any, Any, str, bool]] = []
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        for name, info in cls.model_fields.items():
            required = info.is_required()
            rows.append((name, info.annotation, None if required else info.default, info.description or name,
                         required))
    elif dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            default = f.default if f.default is not dataclasses.MISSING else (
                None if f.default_factory is dataclasses.MISSING else f.default_factory())
            if "help" not in f.metadata:
                raise ValueError(f"{cls.__name__}.{f.name}: a CLI field needs metadata={{'help': ...}}")
            rows.append((f.name, hints[f.name], default, f.metadata["help"], required))
    else:
        raise TypeError(f"expected a pydantic model or a dataclass, got {cls!r}")
    return [Option(names.get(name, name), kind, default, text, required, dest=dest_prefix + name,
                   aliases=aliases.get(name, ()))
            for name, kind, default, text, required in rows if name not in skipped]


def add_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, options: Iterable[Option], *,
                env_prefix: str | None = None) -> None:
    """Add each option as a flag; `env_prefix` names the env var in the help (`PREFIX` + NAME)."""
    for o in options:
        dest = o.dest or o.name
        shown = "required" if o.required else f"default: {'unset' if o.default is None else o.default}"
        if env_prefix and not o.required:
            shown += f"; env {env_prefix}{dest.upper()}"
        kwargs: dict[str, Any] = {"dest": dest, "help": f"{o.help} ({shown})", "required": o.required}
        if not o.required:
            kwargs["default"] = argparse.SUPPRESS
        flags = ["--" + o.name.replace("_", "-"), *o.aliases]
        if arg_type(o.kind) is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            parser.add_argument(*flags, type=arg_type(o.kind), metavar=o.name.upper(), **kwargs)


def given(args: argparse.Namespace, options: Iterable[Option], *, strip_prefix: str = "") -> dict[str, Any]:
    """The values of `options` set on the command line, keyed by destination (less `strip_prefix`)."""
    values = vars(args)
    out = {}
    for o in options:
        dest = o.dest or o.name
        if dest in values:
            out[dest.removeprefix(strip_prefix)] = values[dest]
    return out


def flag_problems(exc: ValidationError) -> str:
    """A settings model's validation errors as one line naming each flag and the value it was given:
    `--port: Input should be less than or equal to 65535 (got 70000)`."""
    problems = []
    for err in exc.errors():
        if not err["loc"]:  # a model-level check; by this project's convention its message starts `field: `
            msg = err["msg"].removeprefix("Value error, ")
            named = re.match(r"([a-z][a-z0-9_]*): ", msg)
            problems.append(f"--{named.group(1).replace('_', '-')}: {msg[named.end():]}" if named else msg)
            continue
        name = str(err["loc"][0])
        flag = "--" + name.replace("_", "-")
        secret = any(word in name for word in ("token", "key", "password", "secret"))  # never echoed
        shown = "input" in err and not isinstance(err["input"], dict) and not secret  # a dict: the whole model
        got = f" (got {err['input']!r})" if shown else ""
        problems.append(f"{flag}: {err['msg']}{got}")
    return "; ".join(problems)
