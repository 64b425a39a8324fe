"""The ONNX Runtime encoder backend: the same sentence-transformers model, exported once, run without torch.

Why: on a CPU a retriever process that imports sentence-transformers spends ~13 s importing it (torch,
transformers, scikit-learn, SciPy, pandas); with ONNX Runtime + the `tokenizers` library it is up in ~1.5 s,
and short query batches run faster on a CPU without native bf16 (figures: docs/results.md). Embeddings are
the torch backend's to float32 rounding (tests/retriever/test_onnx_backend.py), so one index serves both.

The export (`exported_model`) loads the model with sentence-transformers once, on first use, and writes into
the user cache `onnx/<name>-<key>/`: `model.onnx` (the transformer: token ids + attention mask -> last hidden
states), `tokenizer.json`, and `sisrl_onnx.json` with what the torch backend reads from the model at load
(dimension, prompts, pooling, position limit, input names). Supported: the Transformer -> Pooling (mean or CLS)
-> optional Normalize pipelines of ST's usual retrieval models; anything else raises `UnsupportedModel`, and
`--backend auto` then uses torch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sisrl.common.atomic import atomic_dir, atomic_path, file_lock
from sisrl.common.cache import user_cache_dir

logger = logging.getLogger(__name__)

FORMAT = "sisrl-onnx-encoder/1"
META_FILE = "sisrl_onnx.json"
OPSET = 17
POOLINGS = ("mean", "cls")


class UnsupportedModel(ValueError):
    """The model's sentence-transformers pipeline is not one the ONNX backend reproduces exactly."""


def onnxruntime_available() -> bool:
    return importlib.util.find_spec("onnxruntime") is not None


@dataclass(frozen=True)
class OnnxMeta:
    """What the torch backend learns from a loaded model, recorded at export so serving needs no torch."""

    dim: int
    prompts: dict[str, str]
    pooling: str  # ST's pooling mode name (`mean`, `cls`): part of the encoder identity
    position_limit: int | None
    do_lower_case: bool
    input_names: tuple[str, ...]
    pad_id: int


def source_key(source: str) -> str:
    """A cache key for a model: its path plus each file's size and mtime (cheap, and a changed file re-exports).

    A hub id is keyed by its name; clear `<cache>/onnx` after the hub copy changes.
    """
    path = Path(source)
    digest = hashlib.sha256(f"{FORMAT}\0{source}".encode())
    if path.is_dir():
        # ST's own onnx/ or openvino/ subfolders are exports, not the weights this export is made from.
        for file in sorted(p for p in path.rglob("*") if p.is_file()
                           and not {"onnx", "openvino"} & set(p.relative_to(path).parts)):
            stat = file.stat()
            digest.update(f"\0{file.relative_to(path)}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def export_dir(source: str) -> Path:
    name = Path(source).name or source.replace("/", "--")
    return user_cache_dir("onnx") / f"{name.replace('/', '--')}-{source_key(source)}"


def exported_model(source: str) -> Path:
    """The export directory of `source` (a local ST directory or hub id); exports on first use (needs torch)."""
    target = export_dir(source)
    if (target / META_FILE).is_file():
        return target
    with file_lock(target.with_name(target.name + ".lock")):
        if (target / META_FILE).is_file():
            return target
        started = time.perf_counter()
        with atomic_dir(target, overwrite=False) as tmp:
            _export(source, tmp)
        logger.info("exported %s to ONNX in %s (%.1fs)", source, target, time.perf_counter() - started)
    return target


def quantized_model(directory: Path) -> Path:
    """`model.int8.onnx` beside an export: ONNX Runtime's dynamic quantisation (int8 weights, activations
    quantised per batch at run time), made once on first use (`--backend onnx-int8`)."""
    target = directory / "model.int8.onnx"
    if target.is_file():
        return target
    with file_lock(directory.with_name(directory.name + ".lock")):
        if not target.is_file():
            from onnxruntime.quantization import QuantType, quantize_dynamic

            started = time.perf_counter()
            with atomic_path(target) as tmp:
                quantize_dynamic(str(directory / "model.onnx"), str(tmp), weight_type=QuantType.QInt8)
            logger.info("quantised %s to int8 in %.1fs", directory, time.perf_counter() - started)
    return target


def _check_pipeline(model: Any) -> tuple[str, bool]:
    """(pooling mode, lowercase) of a Transformer -> Pooling -> [Normalize] model; UnsupportedModel otherwise."""
    from sisrl.retriever.encoder import _pooling_mode

    kinds = [type(module).__name__ for module in model]
    if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise UnsupportedModel(f"modules {kinds}: the ONNX backend runs Transformer -> Pooling -> [Normalize]")
    pooling = _pooling_mode(model)
    if pooling not in POOLINGS:
        raise UnsupportedModel(f"pooling {pooling!r}: the ONNX backend pools by {' or '.join(POOLINGS)}")
    if model[1].get_config_dict().get("include_prompt", True) is False:
        raise UnsupportedModel("pooling excludes the prompt tokens (include_prompt=false)")
    return pooling, bool(getattr(model[0], "do_lower_case", False))


def _export(source: str, out: Path) -> None:
    import torch
    from sentence_transformers import SentenceTransformer
    from sisrl.retriever.encoder import model_facts

    try:
        model = SentenceTransformer(source, device="cpu").eval()
    except (OSError, ValueError) as err:
        raise ValueError(f"EncoderConfig.model: cannot load {source!r} to export it to ONNX: {err}") from err
    pooling, lower = _check_pipeline(model)
    tokenizer = model.tokenizer
    if not getattr(tokenizer, "is_fast", False):
        raise UnsupportedModel(f"tokenizer {type(tokenizer).__name__} has no fast (tokenizers) version")
    sample = tokenizer(["query: a short example", "passage: a slightly longer example text"], padding=True,
                       return_tensors="pt")
    names = tuple(name for name in ("input_ids", "attention_mask", "token_type_ids") if name in sample)
    transformer: Any = model[0].auto_model

    class Hidden(torch.nn.Module):
        """The transformer alone: inputs by name -> last hidden states [batch, seq, dim]."""

        def __init__(self) -> None:
            super().__init__()
            self.inner: Any = transformer

        def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
            return self.inner(**dict(zip(names, inputs, strict=True))).last_hidden_state

    axes = {name: {0: "batch", 1: "tokens"} for name in (*names, "hidden")}
    with torch.inference_mode(False), torch.no_grad():
        # The TorchScript exporter: one static graph with dynamic batch and length axes (the dynamo exporter
        # needs onnxscript and specialises shapes it sees as constants).
        torch.onnx.export(Hidden().eval(), tuple(sample[name] for name in names), str(out / "model.onnx"),
                          input_names=list(names), output_names=["hidden"], dynamic_axes=axes, opset_version=OPSET,
                          dynamo=False)
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    facts = model_facts(model)
    meta = {"format": FORMAT, "source": source, "dim": facts.dim, "prompts": facts.prompts, "pooling": pooling,
            "position_limit": facts.position_limit, "do_lower_case": lower, "input_names": list(names),
            "pad_id": int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0),
            "torch": torch.__version__, "opset": OPSET}
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def read_meta(directory: Path) -> OnnxMeta:
    raw = json.loads((directory / META_FILE).read_text())
    if raw.get("format") != FORMAT:
        raise ValueError(f"{directory / META_FILE}: format {raw.get('format')!r}, expected {FORMAT!r}")
    return OnnxMeta(dim=int(raw["dim"]), prompts=dict(raw["prompts"]), pooling=str(raw["pooling"]),
                    position_limit=raw["position_limit"], do_lower_case=bool(raw["do_lower_case"]),
                    input_names=tuple(raw["input_names"]), pad_id=int(raw["pad_id"]))


class OnnxModel:
    """An exported transformer in an ONNX Runtime session plus its tokenizer; `embed` pools like ST does."""

    def __init__(self, directory: Path, *, device: str = "cpu", threads: int = 0, int8: bool = False) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self.meta = read_meta(directory)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
        if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":  # `serve` sets it (see retriever/cli.py)
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device.startswith("cuda") else \
            ["CPUExecutionProvider"]
        weights = quantized_model(directory) if int8 else directory / "model.onnx"
        self.session = ort.InferenceSession(str(weights), options, providers=providers)
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.tokenizer.no_padding()

    def token_ids(self, texts: list[str], max_length: int) -> list[list[int]]:
        """Token ids with special tokens, cut to `max_length` (the HF tokenizer's `truncation=True`)."""
        self.tokenizer.enable_truncation(max_length)
        prepared = [t.lower() for t in texts] if self.meta.do_lower_case else list(texts)
        return [encoding.ids for encoding in self.tokenizer.encode_batch(prepared, add_special_tokens=True)]

    def embed(self, texts: list[str], *, max_length: int, batch_size: int) -> np.ndarray:
        """`[n, dim]` float32 pooled (not normalised) vectors, in input order; batches by descending length."""
        ids = self.token_ids(texts, max_length)
        order = np.argsort([-len(row) for row in ids], kind="stable")
        out = np.empty((len(texts), self.meta.dim), dtype=np.float32)
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            width = max(len(ids[i]) for i in rows)
            input_ids = np.full((len(rows), width), self.meta.pad_id, dtype=np.int64)  # [b, width]
            mask = np.zeros((len(rows), width), dtype=np.int64)
            for j, i in enumerate(rows):
                input_ids[j, :len(ids[i])] = ids[i]
                mask[j, :len(ids[i])] = 1
            feeds = {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": np.zeros_like(input_ids)}
            hidden = self.session.run(["hidden"], {name: feeds[name] for name in self.meta.input_names})[0]
            out[rows] = _pool(hidden, mask, self.meta.pooling)  # hidden: [b, width, dim]
        return out


def _pool(hidden: np.ndarray, mask: np.ndarray, pooling: str) -> np.ndarray:
    if pooling == "cls":
        return hidden[:, 0, :]
    weights = mask[..., None].astype(np.float32)  # [b, width, 1]
    return (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)


__all__ = ["OnnxModel", "OnnxMeta", "UnsupportedModel", "exported_model", "onnxruntime_available", "read_meta"]
