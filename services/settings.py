"""Gateway settings: pydantic-settings with the `SISRL_GATEWAY_` env prefix, validated at load.

The CLI builds a `GatewaySettings` from its options; `create_app(settings)` takes it. Nothing is read at import.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sisrl.common.hardware import DTYPE_NAMES
from sisrl.common.wire import GATEWAY_PORT, RETRIEVER_URL, RUNS_ROOT

ENGINES = ("local", "vllm-http", "vllm", "scripted")


class GatewaySettings(BaseSettings):
    """Every option of the gateway; env var = `SISRL_GATEWAY_` + field name in upper case."""

    model_config = SettingsConfigDict(env_prefix="SISRL_GATEWAY_", extra="forbid")

    store_only: bool = Field(default=False, description="serve the store, its REST API and the viewer with no engine "
                             "and no model load (generation routes answer 503); only the tokenizer is read")
    engine: str = Field(default="local", description=f"inference engine: one of {ENGINES}")
    model: str = Field(default="smollm2-135m-instruct", description="policy model name, directory or hub id")
    tokenizer: str | None = Field(default=None, description="tokenizer directory or id (default: the model); "
                                  "store-only reads its tokenizer.json to show token texts")
    dtype: str = Field(default="auto", description="local engine dtype: auto (bfloat16 only where native: CUDA, "
                       "or a CPU with amx_bf16/avx512_bf16; else float32) | float32 | bfloat16 | float16")
    engine_url: str | None = Field(default=None, description="base URL of the vLLM server (engine vllm-http)")
    script: Path | None = Field(default=None, description="JSON script of the scripted policy (engine scripted)")
    retriever_url: str = Field(default=RETRIEVER_URL, description="Search-R1 compatible retriever")
    db_url: str = Field(default="sqlite:///gateway.db", description="SQLAlchemy URL of the rollout store")
    host: str = Field(default="127.0.0.1", description="bind address")
    port: int = Field(default=GATEWAY_PORT, ge=1, le=65535)
    api_token: SecretStr | None = Field(default=None,
                                        description="bearer token for every non-health route (unset = open)")
    # The trainer pushes RUN_DIR/policy/v<N> with RUN_DIR under `runs/` by default: the same folder, so the
    # two defaults work together when both start in one working directory.
    checkpoint_root: Path = Field(default=Path(RUNS_ROOT), description="POST /v1/policy paths must lie under it")
    topk: int = Field(default=3, ge=1, le=50, description="passages per search")
    observation_max_tokens: int = Field(default=512, ge=16, le=8192, description="token budget of one observation")
    max_response_tokens: int = Field(default=2048, ge=16, le=65536, description="response budget per trajectory")
    max_concurrency: int = Field(default=64, ge=1, le=4096, description="trajectories generating at once")
    max_pending: int = Field(default=4096, ge=1, le=10**6, description="queued + running trajectories before 429")
    max_request_bytes: int = Field(default=8 * 2**20, ge=1024, le=2**30, description="request body limit")
    format_weight: float = Field(default=0.0, ge=0.0, le=1.0, description="weight of the format reward")
    retriever_timeout_s: float = Field(default=30.0, gt=0, le=600)
    retriever_retries: int = Field(default=4, ge=0, le=20, description="retries after the first attempt")
    retriever_backoff_s: float = Field(default=0.5, ge=0, le=60, description="first retry delay, doubled per retry")
    retriever_batch_size: int = Field(default=64, ge=1, le=4096, description="queries per coalesced request")
    retriever_window_ms: float = Field(default=2.0, ge=0, le=1000, description="wait to coalesce queries")
    log_level: str = Field(default="info", description="debug | info | warning | error")

    @model_validator(mode="after")
    def _check(self) -> GatewaySettings:
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype: unknown dtype {self.dtype!r}, expected one of {DTYPE_NAMES}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine: unknown engine {self.engine!r}, expected one of {ENGINES}")
        if self.engine == "vllm-http" and not self.engine_url and not self.store_only:  # store-only: no engine
            raise ValueError("engine_url: required with engine 'vllm-http' (e.g. http://127.0.0.1:8001)")
        if self.engine == "scripted" and self.script is None and not self.store_only:
            raise ValueError("script: required with engine 'scripted' (a JSON file, see docs/gateway.md)")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level: expected debug|info|warning|error, got {self.log_level!r}")
        if self.api_token is not None and len(self.api_token.get_secret_value()) < 8:
            raise ValueError("api_token: expected at least 8 characters")
        return self
