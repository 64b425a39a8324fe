"""bench/retriever.py (its workloads, question pool and clients) for the other benches, loaded by path: inside
bench/ the name `retriever` is also sisrl's package folder."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def bench_retriever() -> ModuleType:
    """bench/retriever.py as the module `bench_retriever` (registered in sys.modules: its dataclasses look their
    module up while being defined)."""
    if "bench_retriever" in sys.modules:
        return sys.modules["bench_retriever"]
    spec = importlib.util.spec_from_file_location("bench_retriever", Path(__file__).with_name("retriever.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_retriever"] = module
    spec.loader.exec_module(module)
    return module
