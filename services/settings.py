"""Gateway settings: pydantic-settings with the `SISRL_GATEWAY_` env prefix, validated at load.

The CLI builds a `GatewaySettings` from its options; `create_app(settings)` takes it. Nothing is read at import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sisrl.common.hardware import DTYPE_NAMES
from sisrl.common.secrets import check_token, secrets_from_files
from sisrl.common.wire import GATEWAY_PORT, RETRIEVER_URL, RUNS_ROOT
from sisrl.services.retrieval_client import retriever_urls, split_urls

ENGINES = ("local", "vllm-http", "vllm", "scripted")
ENV_PREFIX = "SISRL_GATEWAY_"
# Each secret setting and its environment variable; `<name>_file` names a file holding it (sisrl.common.secrets).
SECRETS = {name: ENV_PREFIX + name.upper() for name in ("api_token", "retriever_token", "engine_api_key")}
# Secrets that have no command-line flag at all: the environment or their file only.
ENV_ONLY = ("retriever_token",)


class GatewaySettings(BaseSettings):
    """Every option of the gateway; env var = `SISRL_GATEWAY_` + field name in upper case."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    store_only: bool = Field(default=False, description="serve the store, its REST API and the viewer with no engine "
                             "and no model load (generation routes answer 503); only the tokenizer is read")
    engine: str = Field(default="local", description=f"inference engine: one of {ENGINES}")
    model: str = Field(default="smollm2-135m-instruct", description="policy model name, directory or hub id")
    tokenizer: str | None = Field(default=None, description="tokenizer directory or id (default: the model); "
                                  "store-only reads its tokenizer.json to show token texts")
    dtype: str = Field(default="auto", description="engine dtype: auto (local: bfloat16 only where native: CUDA, "
                       "or a CPU with amx_bf16/avx512_bf16, else float32; vllm in process: vLLM's choice) | "
                       "float32 | bfloat16 | float16 (vllm-http: the server's --dtype)")
    engine_url: str | None = Field(default=None, description="base URL of the vLLM server (engine vllm-http); "
                                   "several, comma-separated, form a pool: each trajectory stays on one server "
                                   "(least loaded at its first turn), a failing one is skipped and probed back, "
                                   "every one loads each new policy")
    engine_api_key: SecretStr | None = Field(default=None, description="bearer token the vllm-http engine sends "
                                             "(the server's --api-key / SISRL_ENGINE_API_TOKEN; unset = none); "
                                             "give it by env var or --engine-api-key-file, not as a flag")
    engine_api_key_file: Path | None = Field(default=None, description="file holding engine_api_key (e.g. a "
                                             "mounted secret); its trailing newline is dropped")
    engine_weights_route: str = Field(default="/v1/load_weights", description="vllm-http weight-load route: "
                                      "/v1/load_weights (sisrl's policy server) or /collective_rpc (vLLM with "
                                      "VLLM_SERVER_DEV_MODE=1 and the SafetensorsReload worker extension)")
    engine_after_weights_routes: str = Field(default="", description="comma-separated routes the vllm-http engine "
                                             "POSTs after a weight load (vLLM: /reset_prefix_cache); empty = none")
    engine_timeout_s: float = Field(default=600.0, gt=0, le=86400, description="vllm-http request timeout")
    engine_retries: int = Field(default=3, ge=0, le=20, description="vllm-http retries of a failed generation "
                                "(a weight load is retried only when its connection never opened)")
    engine_retry_budget_s: float = Field(default=120.0, ge=0, le=86400, description="vllm-http: seconds one "
                                         "generation may take over all its attempts; no retry starts past it (a "
                                         "generation that timed out is never retried: the server ran it once)")
    engine_max_model_len: int | None = Field(default=None, ge=16, le=2**20, description="engine vllm (in "
                                             "process): context length (unset: the model's)")
    engine_enforce_eager: bool = Field(default=False, description="engine vllm (in process): no CUDA graphs / "
                                       "compilation (faster start, needed on CPU builds)")
    script: Path | None = Field(default=None, description="JSON script of the scripted policy (engine scripted)")
    script_base: str | None = Field(default=None, description="engine scripted: also run this engine (local | "
                                    "vllm-http) on every real context, as many tokens as the scripted turn; the "
                                    "script's tokens are recorded (unset: the script alone)")
    retriever_url: str = Field(default=RETRIEVER_URL, description="Search-R1 compatible retriever: its base URL "
                               "or its /retrieve endpoint (as Search-R1's retriever.url); several, "
                               "comma-separated, share the queries (least in flight; a failing one is skipped "
                               "and probed back)")
    retriever_token: SecretStr | None = Field(default=None, description="bearer token sent on every search (the "
                                              "retriever's SISRL_RETRIEVER_API_TOKEN); env var or "
                                              "--retriever-token-file only, no flag (unset = none)")
    retriever_token_file: Path | None = Field(default=None, description="file holding retriever_token (e.g. a "
                                              "mounted secret); its trailing newline is dropped")
    db_url: str = Field(default="sqlite:///gateway.db", description="SQLAlchemy URL of the rollout store")
    host: str = Field(default="127.0.0.1", description="bind address")
    port: int = Field(default=GATEWAY_PORT, ge=1, le=65535)
    api_token: SecretStr | None = Field(default=None, description="bearer token for every non-health route "
                                        "(unset = open); give it by env var or --api-token-file, not as a flag")
    api_token_file: Path | None = Field(default=None, description="file holding api_token (e.g. a mounted "
                                        "secret); its trailing newline is dropped")
    # The trainer pushes RUN_DIR/policy/v<N> with RUN_DIR under `runs/` by default: the same folder, so the
    # two defaults work together when both start in one working directory.
    checkpoint_root: Path = Field(default=Path(RUNS_ROOT), description="POST /v1/policy paths must lie under it")
    topk: int = Field(default=3, ge=1, le=50, description="passages per search")
    observation_max_tokens: int = Field(default=512, ge=16, le=8192, description="token budget of one observation")
    max_response_tokens: int = Field(default=2048, ge=16, le=65536, description="response budget per trajectory")
    topk_logprobs_dtype: Literal["float32", "float16"] = Field(
        default="float32", description="precision the store keeps each recorded top-K log-prob in: float16 rounds "
        "it to the nearest half float (|error| <= 2^-11 |log q|: a top-K probability moves by at most 1.8e-4; "
        "the floor -9999 reads -10000) and Arrow pages then carry the top-K log-probs in 2 bytes instead of 4. "
        "The sampled tokens' log-probs stay float32. Both forms of a batch give the same values")
    max_concurrency: int = Field(default=64, ge=1, le=4096, description="trajectories generating at once")
    prefix_cache_tokens: int = Field(default=8192, ge=0, le=2**24, description="local engine: tokens of KV kept "
                                     "from finished turns so an agent's next turn prefills only its new tokens "
                                     "(0 = off; oldest out first). To keep every running trajectory's, give about "
                                     "max_concurrency x its context length; memory is that many tokens' KV")
    max_pending: int = Field(default=4096, ge=1, le=10**6, description="queued + running trajectories before 429")
    max_request_bytes: int = Field(default=8 * 2**20, ge=1024, le=2**30, description="request body limit")
    format_weight: float = Field(default=0.0, ge=0.0, le=1.0, description="weight of the format reward")
    retriever_timeout_s: float = Field(default=30.0, gt=0, le=600)
    retriever_retries: int = Field(default=4, ge=0, le=20, description="retries after the first attempt")
    retriever_backoff_s: float = Field(default=0.5, ge=0, le=60, description="first retry delay, doubled per retry")
    retriever_batch_size: int = Field(default=64, ge=1, le=4096, description="queries per coalesced request")
    retriever_window_ms: float = Field(default=2.0, ge=0, le=1000, description="wait to coalesce queries")
    log_level: str = Field(default="info", description="debug | info | warning | error")

    @model_validator(mode="before")
    @classmethod
    def _read_secret_files(cls, values: Any) -> Any:
        return secrets_from_files(values, SECRETS)

    @model_validator(mode="after")
    def _check(self) -> GatewaySettings:
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype: unknown dtype {self.dtype!r}, expected one of {DTYPE_NAMES}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine: unknown engine {self.engine!r}, expected one of {ENGINES}")
        loads_here = not self.store_only and (self.engine in ("local", "vllm") or self.script_base == "local")
        if loads_here and self.model.startswith(("/", "./", "../", "~")) and not Path(self.model).expanduser().exists():
            raise ValueError(f"model: no such directory {self.model!r} (give a Hugging Face model directory, the "
                             f"offline alias 'smollm2-135m-instruct', or a hub id)")
        if self.engine == "vllm-http" and not self.engine_url and not self.store_only:  # store-only: no engine
            raise ValueError("engine_url: required with engine 'vllm-http' (e.g. http://127.0.0.1:8001)")
        if self.script_base not in (None, "local", "vllm-http"):
            raise ValueError(f"script_base: expected local or vllm-http, got {self.script_base!r}")
        if self.script_base == "vllm-http" and not self.engine_url and not self.store_only:
            raise ValueError("engine_url: required with script_base 'vllm-http' (e.g. http://127.0.0.1:8001)")
        if self.engine == "scripted" and self.script is None and not self.store_only:
            raise ValueError("script: required with engine 'scripted' (a JSON file, see docs/gateway.md)")
        for route in (self.engine_weights_route, *self.after_weights_routes):
            if not route.startswith("/"):
                raise ValueError(f"engine_weights_route / engine_after_weights_routes: expected routes starting "
                                 f"with '/', got {route!r}")
        try:
            retriever_urls(self.retriever_url)
        except ValueError as exc:
            raise ValueError(f"retriever_url: {exc}") from None
        if self.engine_url is not None:
            try:
                split_urls(self.engine_url, what="engine")
            except ValueError as exc:
                raise ValueError(f"engine_url: {exc}") from None
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level: expected debug|info|warning|error, got {self.log_level!r}")
        check_token(self.api_token, "api_token", SECRETS["api_token"])
        # No flag: the error names the variable (upper case, so no `--retriever-token` is made of it). The engine
        # key is the engine server's (vLLM's --api-key): its length is that server's business.
        check_token(self.retriever_token, SECRETS["retriever_token"], SECRETS["retriever_token"])
        return self

    @property
    def retriever_urls(self) -> list[str]:
        """`retriever_url` split at commas, each as its base URL (a trailing `/retrieve` and `/` cut)."""
        return retriever_urls(self.retriever_url)

    @property
    def engine_urls(self) -> list[str]:
        """`engine_url` split at commas ([] when unset)."""
        return split_urls(self.engine_url, what="engine") if self.engine_url else []

    @property
    def after_weights_routes(self) -> tuple[str, ...]:
        """`engine_after_weights_routes` split at commas (blanks dropped)."""
        return tuple(r.strip() for r in self.engine_after_weights_routes.split(",") if r.strip())
