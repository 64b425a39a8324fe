"""Token texts for the viewer: decode ids with the policy's tokenizer (the `tokenizers` library only).

A live gateway reuses the tokenizer it already loaded. `--store-only` loads only `tokenizer.json` (no
transformers, no torch, no weights: ~0.2 s) from `--tokenizer`, else `--model`: a directory; the name
`smollm2-135m-instruct` (its converted directory in the user cache); or a hub id already in the local Hugging
Face cache (never downloaded). When none is found, the viewer shows token ids and this is logged once.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sisrl.common.cache import user_cache_dir

log = logging.getLogger(__name__)
SMOLLM2 = "smollm2-135m-instruct"  # sisrl.common.models.SMOLLM2; not imported from there (that imports torch)


class TokenTexts:
    """Decodes token ids; ids outside the vocabulary decode to `<id N>` instead of failing."""

    def __init__(self, backend: Any, name: str) -> None:
        self.backend = backend  # a tokenizers.Tokenizer
        self.name = name
        self.size = int(backend.get_vocab_size(with_added_tokens=True))

    def _known(self, ids: list[int]) -> list[int]:
        return [i for i in ids if 0 <= i < self.size]

    def pieces(self, ids: list[int]) -> list[str]:
        """Each id decoded alone (a byte of a multi-byte character decodes to U+FFFD), special tokens kept."""
        known = self._known(ids)
        decoded = dict(zip(known, self.backend.decode_batch([[i] for i in known], skip_special_tokens=False),
                           strict=True))
        return [decoded.get(i, f"<id {i}>") for i in ids]

    def text(self, ids: list[int]) -> str:
        return str(self.backend.decode(self._known(ids), skip_special_tokens=False))


def from_loaded(tokenizer: Any, name: str) -> TokenTexts | None:
    """Wrap a transformers fast tokenizer's backend; None for a slow tokenizer (no backend)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return TokenTexts(backend, name) if backend is not None else None


def tokenizer_file(name_or_path: str) -> Path | None:
    """`tokenizer.json` of a directory, of the converted SmolLM2, or of a hub id in the local HF cache."""
    if name_or_path == SMOLLM2:
        path = user_cache_dir("models") / SMOLLM2 / "tokenizer.json"
        return path if path.is_file() else None
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return local / "tokenizer.json" if (local / "tokenizer.json").is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, "tokenizer.json")
    except (ImportError, ValueError):  # not a repo id
        return None
    return Path(cached) if isinstance(cached, str) else None


def load_texts(name_or_path: str) -> TokenTexts | None:
    """The decoder of `name_or_path` from its `tokenizer.json` alone, or None (logged) when there is none."""
    path = tokenizer_file(name_or_path)
    if path is None:
        log.warning("no tokenizer.json for %r (a directory, %s once converted, or a hub id in the local cache): "
                    "the viewer shows token ids; pass --tokenizer DIR for texts", name_or_path, SMOLLM2)
        return None
    from tokenizers import Tokenizer

    try:
        return TokenTexts(Tokenizer.from_file(str(path)), name_or_path)
    except Exception as exc:  # a corrupt or foreign file: the store is still worth serving
        log.warning("could not load %s (%s: %s): the viewer shows token ids", path, type(exc).__name__, exc)
        return None
