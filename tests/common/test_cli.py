"""The one settings -> argparse generator (`sisrl.common.cli`), on a pydantic model and on a dataclass."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from pydantic import BaseModel, Field, SecretStr, ValidationError
from sisrl.common.cli import DefaultsHelp, add_options, field_options, flag_problems, given


class Model(BaseModel):
    url: str = Field(default="http://127.0.0.1:8000", description="where to send requests")
    retries: int | None = Field(default=None, description="attempts after the first")
    verbose: bool = Field(default=False, description="say more")


@dataclass(frozen=True)
class Config:
    out: Path = field(metadata={"help": "output folder"})
    rate: float = field(default=0.5, metadata={"help": "a rate"})


def _parser(*options: object, env_prefix: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t", exit_on_error=False)
    add_options(parser, options, env_prefix=env_prefix)  # type: ignore[arg-type]
    return parser


def test_flags_types_defaults_and_help_come_from_the_fields(capsys: pytest.CaptureFixture[str]) -> None:
    options = [*field_options(Model), *field_options(Config, dest_prefix="cfg_")]
    parser = _parser(*options, env_prefix="T_")
    args = parser.parse_args(["--retries", "3", "--no-verbose", "--out", "x", "--rate", "2"])
    assert given(args, options) == {"retries": 3, "verbose": False, "cfg_out": Path("x"), "cfg_rate": 2.0}
    assert given(args, field_options(Config, dest_prefix="cfg_"), strip_prefix="cfg_") == {"out": Path("x"),
                                                                                          "rate": 2.0}
    assert given(parser.parse_args(["--out", "y"]), options) == {"cfg_out": Path("y")}  # unset: left to defaults
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "where to send requests (default: http://127.0.0.1:8000; env T_URL)" in text
    assert "attempts after the first (default: unset; env T_RETRIES)" in text
    assert "output folder (required)" in text


def test_a_bad_value_and_a_missing_required_flag_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    parser = _parser(*field_options(Model), *field_options(Config))
    with pytest.raises(argparse.ArgumentError, match="retries.*invalid int value: 'many'"):
        parser.parse_args(["--out", "x", "--retries", "many"])
    with pytest.raises(SystemExit):
        parser.parse_args([])
    assert "the following arguments are required: --out" in capsys.readouterr().err


def test_a_dataclass_field_without_help_is_an_error() -> None:
    @dataclass
    class Bare:
        n: int = 1

    with pytest.raises(ValueError, match=r"Bare\.n: a CLI field needs metadata"):
        field_options(Bare)


class Limits(BaseModel):
    port: int = Field(ge=1, le=65535, description="port")
    api_token: SecretStr | None = Field(default=None, min_length=8, description="token")


def test_flag_problems_name_each_flag_and_its_value_but_never_a_secret() -> None:
    with pytest.raises(ValidationError) as bad:
        Limits(port=70000, api_token="hunter2")  # type: ignore[arg-type]
    line = flag_problems(bad.value)
    assert line.startswith("--port: Input should be less than or equal to 65535 (got 70000); --api-token: ")
    assert "hunter2" not in line and "\n" not in line
    with pytest.raises(ValidationError) as missing:
        Limits()  # type: ignore[call-arg]
    assert flag_problems(missing.value) == "--port: Field required"


def test_help_says_required_instead_of_a_none_default() -> None:
    parser = argparse.ArgumentParser(prog="t", formatter_class=DefaultsHelp)
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--limit", type=int, default=3, help="at most")
    text = " ".join(parser.format_help().split())
    assert "output folder (required)" in text and "at most (default: 3)" in text and "None" not in text
