"""Every option of the policy server, one frozen dataclass: each field is one CLI flag (`sisrl.services.engines.
openai_server.cli`), validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pydantic import SecretStr
from sisrl.common.secrets import MIN_TOKEN_CHARS, check_token
from sisrl.common.wire import ENGINE_PORT

TOKEN_ENV = "SISRL_ENGINE_API_TOKEN"


@dataclass(frozen=True)
class ServerSettings:
    """Every option of the server; each field is one CLI flag (`--max-batch-size`, ...)."""

    model: str = field(default="smollm2-135m-instruct", metadata={"help": "policy name or HF directory"})
    served_model_name: str | None = field(
        default=None, metadata={"help": "model name in responses; unset means the --model value"}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "bind address"})
    port: int = field(default=ENGINE_PORT, metadata={"help": "bind port"})
    max_batch_size: int = field(default=32, metadata={"help": "most sequences decoded together"})
    max_logprobs: int = field(default=20, metadata={"help": "largest `logprobs` (K) a request may ask for"})
    max_tokens: int = field(default=4096, metadata={"help": "largest `max_tokens` a request may ask for"})
    checkpoint_root: str | None = field(
        default=None,
        metadata={"help": "weights may be loaded only from under this folder (unset: loading off)"},
    )
    dtype: str = field(default="auto", metadata={"help": "model dtype: auto (bfloat16 only where native), "
                                                 "float32, bfloat16 or float16"})
    threads: int = field(
        default=0, metadata={"help": "torch CPU threads (0: torch's default; 1 on a busy machine)"}
    )
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error"})
    max_body_bytes: int = field(default=8 * 2**20, metadata={"help": "request body limit in bytes (413 beyond)"})
    max_in_flight: int = field(default=256, metadata={"help": "completions handed to the engine at once (it "
                                                      "decodes --max-batch-size of them together); more wait"})
    max_queued: int = field(default=1024, metadata={"help": "completions waiting for a place in flight; one more "
                                                    "is answered 429 with Retry-After"})
    request_timeout_s: float = field(default=600.0, metadata={"help": "deadline of one completion, queue wait "
                                                              "included: past it the generation is cancelled and "
                                                              "answered 503 with Retry-After"})
    api_token: SecretStr | None = field(
        default=None, metadata={"help": f"bearer token, at least {MIN_TOKEN_CHARS} characters (CLI: env "
                                        f"{TOKEN_ENV} or {TOKEN_ENV}_FILE only)"}
    )

    def __post_init__(self) -> None:
        for name in ("port", "max_batch_size", "max_logprobs", "max_tokens", "max_body_bytes", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.port > 65535:
            raise ValueError(f"port must be <= 65535, got {self.port}")
        if self.model.startswith(("/", "./", "../", "~")) and not Path(self.model).expanduser().exists():
            raise ValueError(f"model: no such directory {self.model!r} (give a Hugging Face model directory or the "
                             f"offline alias 'smollm2-135m-instruct')")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        check_token(self.api_token, TOKEN_ENV, TOKEN_ENV)
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = torch's default), got {self.threads}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")

    @property
    def served_name(self) -> str:
        """The model name in responses (`--served-model-name`, else `--model`)."""
        return self.served_model_name or self.model
