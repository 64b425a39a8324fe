"""The torch encoder's traced forward (retriever/traced.py) against sentence-transformers' eager encode."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

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


class _Counted:
    """A graph that counts its calls and keeps their inputs (to see which graph a call took, and in what shape)."""

    def __init__(self, graph: object) -> None:
        self.graph, self.calls = graph, 0
        self.args: list[tuple[Any, ...]] = []

    def __call__(self, *args: Any) -> object:
        self.calls += 1
        self.args.append(args)
        return self.graph(*args)  # type: ignore[operator]


def test_calls_of_short_texts_run_packed_without_padding_and_give_the_eager_vectors() -> None:
    from sisrl.retriever.traced import PACK_LONGEST, PACK_WIDEST

    traced, eager = _torch(batch_size=64), _torch(batch_size=64, trace=False)
    assert traced.traced is not None and traced.traced.packed is not None  # MiniLM is a BERT: packing checked in
    padded, packed = _Counted(traced.traced.graph), _Counted(traced.traced.packed)
    traced.traced.graph, traced.traced.packed = padded, packed
    small = [TEXTS[1:4], TEXTS[3:0:-1], [TEXTS[6], TEXTS[0]], TEXTS[:4] + TEXTS[5:]]  # 2-7 short texts
    big = [t for t in TEXTS if "long" not in t] * 12  # ~100 texts: more than one row takes
    assert sum(map(len, traced._model.tokenizer(big)["input_ids"])) > PACK_WIDEST
    for texts in [*small, big, big[5:40]]:
        mine, ref = traced.encode_queries(texts), eager.encode_queries(texts)
        cosine = np.sum(mine * ref, axis=1)
        assert cosine.min() > 0.99999, (texts, cosine)  # fails if a text sees its neighbours or a pad
    assert padded.calls == 0  # every one of those calls ran packed
    rows = [args[0].shape for args in packed.args]  # ids [rows, width] of each packed call
    assert len(rows) == len(small) + 2 + 1  # big: 2 forwards of at most 64 texts; big[5:40]: 1
    assert all(r > 1 and w <= PACK_WIDEST for r, w in rows[len(small):]), rows
    # a text over PACK_LONGEST tokens (passage-sized) sends its call to padded batches
    with_long = [*big[:20], TEXTS[4]]
    assert len(traced._model.tokenizer([TEXTS[4]])["input_ids"][0]) > PACK_LONGEST
    np.testing.assert_allclose(traced.encode_queries(with_long), eager.encode_queries(with_long), atol=1e-5)
    assert padded.calls > 0


def test_pack_rows_first_fit_longest_first() -> None:
    from sisrl.retriever.traced import pack_rows

    # 50 opens row 0, 40 row 1 (no room beside 50), 30 row 2, 20 fits row 1 (40 + 20), 10 row 0 (50 + 10)
    assert pack_rows([10, 40, 30, 50, 20], 64) == [[3, 0], [1, 4], [2]]
    assert pack_rows([80, 5], 64) == [[0], [1]]  # a text over the width gets a row of its own
    assert pack_rows([], 64) == []


def test_plan_rows_takes_the_least_costly_width() -> None:
    from sisrl.retriever.traced import plan_rows, row_cost

    # a few short texts: one row (31 tokens, nothing padded)
    assert sorted(map(sorted, plan_rows([10, 12, 9]))) == [[0, 1, 2]]
    # one long text and five short ones: two rows of 40 (the long one; the five), not one row of 80 (its attention
    # costs more) nor rows of 48 (the long one and a short one, then four short ones padded to 48)
    lengths = [40, 8, 8, 8, 8, 8]
    assert sorted(map(sorted, plan_rows(lengths))) == [[0], [1, 2, 3, 4, 5]]
    assert row_cost(lengths, [[0], [1, 2, 3, 4, 5]]) < row_cost(lengths, [list(range(6))])
    many = [5 + (7 * i) % 31 for i in range(40)]
    assert sorted(i for row in plan_rows(many) for i in row) == list(range(40))


def test_packed_inputs_in_rows_pad_each_row_apart_from_its_texts() -> None:
    from sisrl.retriever.traced import _packed_inputs

    ids, positions, mask, pool = _packed_inputs([[7, 8, 9], [5, 6], [4]], "mean", [[1, 2], [0]])
    assert ids.tolist() == [[5, 6, 4], [7, 8, 9]] and positions.tolist() == [[0, 1, 0], [0, 1, 2]]
    assert mask.shape == (2, 1, 3, 3)
    assert mask[0, 0].int().tolist() == [[1, 1, 0], [1, 1, 0], [0, 0, 1]]
    ids, positions, mask, pool = _packed_inputs([[7, 8, 9], [5]], "mean", [[0], [1]])
    assert ids.tolist() == [[7, 8, 9], [5, 0, 0]]  # the second row padded to the first's width
    assert mask[1, 0].int().tolist() == [[1, 0, 0], [0, 1, 1], [0, 1, 1]]  # the pads see only each other
    np.testing.assert_allclose(pool.numpy(), [[1 / 3, 1 / 3, 1 / 3, 0, 0, 0], [0, 0, 0, 1, 0, 0]])


def test_packed_inputs_restart_positions_keep_each_text_to_itself_and_pool_by_text() -> None:
    from sisrl.retriever.traced import _packed_inputs

    ids, positions, mask, pool = _packed_inputs([[7, 8, 9], [5, 6]], "mean")
    assert ids.tolist() == [[7, 8, 9, 5, 6]] and positions.tolist() == [[0, 1, 2, 0, 1]]
    assert mask.shape == (1, 1, 5, 5)
    assert mask[0, 0].int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0],
                                         [0, 0, 0, 1, 1], [0, 0, 0, 1, 1]]
    np.testing.assert_allclose(pool.numpy(), [[1 / 3, 1 / 3, 1 / 3, 0, 0], [0, 0, 0, 0.5, 0.5]])
    _, _, _, cls = _packed_inputs([[7, 8, 9], [5, 6]], "cls")
    assert cls.tolist() == [[1, 0, 0, 0, 0], [0, 0, 0, 1, 0]]


def test_a_packed_graph_that_differs_from_sentence_transformers_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Positions that run on across the texts (no restart per text) give other vectors: the load-time check turns
    packing off, and the encoder still gives the eager vectors through its padded graph."""
    import sisrl.retriever.traced as traced_module
    import torch

    original = traced_module._packed_inputs

    def positions_run_on(texts: list[list[int]], mode: str, rows: list[list[int]] | None = None) -> tuple[object, ...]:
        ids, positions, mask, pool = original(texts, mode, rows)
        return ids, torch.arange(ids.shape[1]).expand_as(ids), mask, pool

    monkeypatch.setattr(traced_module, "_packed_inputs", positions_run_on)
    with caplog.at_level("WARNING", logger="sisrl.retriever.traced"):
        traced = _torch()
    assert traced.traced is not None and traced.traced.packed is None
    assert "packed forward differs from sentence-transformers" in caplog.text
    np.testing.assert_allclose(traced.encode_queries(TEXTS[1:4]), _torch(trace=False).encode_queries(TEXTS[1:4]),
                               atol=1e-5)
