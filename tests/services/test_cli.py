"""`sisrl-gateway serve` options: every option's default in --help, bad values named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sisrl.common.procs import free_port
from sisrl.services.cli import build_parser, main, settings_from_args
from sisrl.services.settings import GatewaySettings


def test_help_lists_every_option_with_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name in GatewaySettings.model_fields:
        assert "--" + name.replace("_", "-") in text
    assert "(default: local; env SISRL_GATEWAY_ENGINE)" in text and "(default: 127.0.0.1;" in text
    assert "--retriever RETRIEVER_URL" in text and "--db DB_URL" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--port", "x"], "argument --port: invalid int value: 'x'"),
        (["serve", "--format-weight", "2"], "--format-weight: Input should be less than or equal to 1"),
        (["serve", "--engine", "foo"], "unknown engine 'foo', expected one of"),
        (["serve", "--engine", "vllm-http"], "error: --engine-url: required with engine 'vllm-http'"),
        (["serve", "--model", "/no/such/policy"], "error: --model: no such directory '/no/such/policy' (give a"),
        (["serve", "--bogus"], "unrecognized arguments: --bogus"),
        (["serve", "--prefix-cache-tokens", "-1"], "--prefix-cache-tokens: Input should be greater than or equal to 0"),
    ],
)
def test_bad_options_are_named(argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SISRL_GATEWAY_ENGINE_URL", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in " ".join(capsys.readouterr().err.split())


def test_env_fills_unset_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SISRL_GATEWAY_TOPK", "7")
    parser = build_parser()
    settings = settings_from_args(parser.parse_args(["serve", "--port", "9001"]), parser)
    assert (settings.topk, settings.port, settings.engine) == (7, 9001, "local")


def test_the_prefix_cache_size_reaches_the_local_engine(tiny_policy_dir: Path) -> None:
    from sisrl.common.models import load_tokenizer
    from sisrl.services.live import build_engine

    parser = build_parser()
    for argv, tokens in ((["--prefix-cache-tokens", "40960"], 40960), ([], 8192)):
        args = parser.parse_args(["serve", "--model", str(tiny_policy_dir), "--dtype", "float32", *argv])
        engine = build_engine(settings_from_args(args, parser), load_tokenizer())
        assert engine.prefix_cache.max_tokens == tokens  # type: ignore[attr-defined]


def test_a_model_path_is_only_checked_where_it_is_loaded() -> None:
    served = GatewaySettings(engine="vllm-http", engine_url="http://127.0.0.1:8001", model="/models/on/the/server")
    assert served.model == "/models/on/the/server"  # the vLLM server's own path, not this machine's
    assert GatewaySettings(store_only=True, model="/elsewhere").store_only  # store-only loads no model


def test_a_store_it_cannot_open_stops_the_gateway_with_its_reason(tmp_path: Path) -> None:
    db = tmp_path / "missing" / "x.db"
    done = subprocess.run([sys.executable, "-m", "sisrl.services.cli", "serve", "--store-only", "--port", str(free_port()),
                           "--db-url", f"sqlite:///{db}"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"cannot start the gateway: cannot open the rollout store sqlite:///{db}: unable to open database file" \
        in done.stderr, done.stderr[-2000:]
