"""Where sisrl keeps what it converts or builds once: models, indexes, demo data.

`$SISRL_CACHE` when set, else `$XDG_CACHE_HOME/sisrl`, else `~/.cache/sisrl`. Nothing is written at import.
"""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir(*parts: str) -> Path:
    """Return (and create) `<cache root>/<parts...>`."""
    root = os.environ.get("SISRL_CACHE")
    if root is None:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(xdg) / "sisrl")
    path = Path(root).joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
