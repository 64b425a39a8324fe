"""The torch encoder's traced forward (retriever/traced.py) against sentence-transformers' eager encode."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from sisrl.retriever.encoder import EncoderConfig, TorchEncoder, load_encoder, resolve_model

TEXTS = ["a", "who wrote the origin of species", "capital of peru", "when did the eiffel tower open to the public",
         "long " * 200, "which river flows through the city that hosted the 1992 summer olympics", "x y", "ok"]


def _torch(**kwargs: object) -> TorchEncoder:
    encoder = load_encoder(EncoderConfig(model="minilm", backend="torch", dtype="float32", **kwargs))  # type: ignore[arg-type]
    assert isinstance(encoder, TorchEncoder)
    return encoder


def test_traced_forward_gives_the_eager_vectors_in_input_order() -> None:
    traced, eager = _torch(batch_size=3, max_length=64), _torch(batch_size=3, max_length=64, trace=False)
    assert traced.traced is not None and eager.traced is None
    assert (traced.forward, eager.forward) == ("traced", "eager")  # what /health reports as encoder_forward
    for texts in (TEXTS, TEXTS[:1], TEXTS[::-1]):  # batches of 3 that pad; one row; another order
        mine, ref = traced.encode_queries(texts), eager.encode_queries(texts)
        assert mine.shape == ref.shape == (len(texts), 384) and mine.dtype == np.float32
        cosine = np.sum(mine * ref, axis=1)
        assert cosine.min() > 0.99999, cosine  # a row put back in the wrong place scores ~0.1-0.5 here
    np.testing.assert_allclose(np.linalg.norm(traced.encode_passages(TEXTS), axis=1), 1.0, atol=1e-5)


def test_two_threads_sharing_the_traced_encoder_get_their_own_rows() -> None:
    """The server's encoder threads share one encoder (and one fast tokenizer)."""
    encoder = _torch(batch_size=4)
    serial = {i: encoder.encode_queries(TEXTS[i::2] * 3) for i in range(2)}
    found: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(5):
                found[i] = encoder.encode_queries(TEXTS[i::2] * 3)
                np.testing.assert_allclose(found[i], serial[i], atol=1e-5)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert set(found) == {0, 1}


def test_a_pipeline_the_trace_does_not_cover_stays_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sentence_transformers import SentenceTransformer, models

    monkeypatch.setenv("SISRL_CACHE", str(tmp_path / "cache"))
    base = SentenceTransformer(resolve_model("minilm"), device="cpu")
    pooling = models.Pooling(384, pooling_mode="max")
    SentenceTransformer(modules=[base[0], pooling], device="cpu").save(str(tmp_path / "max"))
    encoder = load_encoder(EncoderConfig(model=str(tmp_path / "max"), backend="torch", dtype="float32"))
    assert isinstance(encoder, TorchEncoder) and encoder.traced is None
    vectors = encoder.encode_queries(TEXTS[:3])
    ref = SentenceTransformer(str(tmp_path / "max"), device="cpu").encode(TEXTS[:3], normalize_embeddings=True)
    np.testing.assert_allclose(vectors, ref, atol=1e-5)


def test_serve_no_trace_reaches_the_encoder_config(tmp_path: Path) -> None:
    from sisrl.retriever.app import searcher_options
    from sisrl.retriever.settings import Settings

    assert searcher_options(Settings(index=tmp_path)).trace is True
    assert searcher_options(Settings(index=tmp_path, trace=False)).trace is False
