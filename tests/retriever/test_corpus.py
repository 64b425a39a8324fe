"""Corpus reading: passages in order, bad lines named by line number or skipped and counted, checksums."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest
from sisrl.retriever.corpus import CorpusError, Passage, ReadStats, iter_passages
from sisrl.retriever.docstore import DocStore, DocStoreWriter

GOOD = [{"id": "a", "contents": '"A"\nfirst'}, {"id": 7, "contents": '"B"\nsecond'}]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_reads_passages_in_order_and_hashes_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.jsonl", [json.dumps(o) for o in GOOD] + [""])
    stats = ReadStats()
    passages = list(iter_passages(path, stats=stats))
    assert [(p.id, p.contents) for p in passages] == [("a", '"A"\nfirst'), ("7", '"B"\nsecond')]
    assert stats.passages == 2 and stats.skipped == 0
    assert stats.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_gzip_corpus_gives_the_same_passages(tmp_path: Path) -> None:
    plain = _write(tmp_path / "c.jsonl", [json.dumps(o) for o in GOOD])
    packed = tmp_path / "c.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    stats = ReadStats()
    assert list(iter_passages(packed, stats=stats)) == list(iter_passages(plain))
    assert stats.sha256 == hashlib.sha256(packed.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    ("bad", "message"),
    [("{not json", "not valid JSON"), ('{"id": "x"}', "missing key(s) ['contents']"),
     ('["id", "contents"]', "expected a JSON object"), ('{"id": "x", "contents": 3}', "'contents' must be a string"),
     ('{"id": null, "contents": "t"}', "'id' must be a string or integer")],
)
def test_bad_line_stops_with_its_line_number(tmp_path: Path, bad: str, message: str) -> None:
    path = _write(tmp_path / "c.jsonl", [json.dumps(GOOD[0]), json.dumps(GOOD[1]), bad])
    with pytest.raises(CorpusError) as info:
        list(iter_passages(path))
    assert f"{path}:3" in str(info.value) and message in str(info.value)


def test_skip_bad_counts_and_keeps_the_good_lines(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.jsonl", ["{oops", json.dumps(GOOD[0]), '{"contents": "no id"}', json.dumps(GOOD[1])])
    stats = ReadStats()
    assert [p.id for p in iter_passages(path, skip_bad=True, stats=stats)] == ["a", "7"]
    assert (stats.skipped, stats.passages, stats.lines) == (2, 2, 4)
    assert ":1:" in stats.skipped_examples[0] and ":3:" in stats.skipped_examples[1]


def test_docstore_round_trip_with_unicode_and_newlines(tmp_path: Path) -> None:
    texts = ['"Zürich"\nline one\nline two', '"東京"\ntext', '"Quote \\" and \r"\nend']
    writer = DocStoreWriter(tmp_path)
    for i, text in enumerate(texts):
        writer.add(Passage(id=str(i), contents=text))
    writer.commit()
    store = DocStore(tmp_path)
    assert len(store) == 3
    assert [store.get(i).contents for i in (2, 0, 1)] == [texts[2], texts[0], texts[1]]
    assert [p.contents for p in store.iter_range(0, 3)] == texts
    with pytest.raises(IndexError, match="row 3 outside"):
        store.get(3)
    store.close()


def test_docstore_refuses_a_truncated_docs_file(tmp_path: Path) -> None:
    writer = DocStoreWriter(tmp_path)
    writer.add(Passage(id="0", contents="x" * 100))
    writer.commit()
    docs = tmp_path / "docs.jsonl"
    docs.write_bytes(docs.read_bytes()[:50])
    with pytest.raises(ValueError, match="truncated"):
        DocStore(tmp_path)
