"""Modules the benches load by path: bench/retriever.py (its workloads, question pool and clients; inside bench/
the name `retriever` is also sisrl's package folder) and tests/utils/pg_cluster.py (a throwaway PostgreSQL
cluster; `tests` is no package a bench can import, and an installed distribution may own that name)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_path(name: str, path: Path) -> ModuleType:
    """The file `path` as the module `name` (registered in sys.modules: its dataclasses look their module up
    while being defined); loaded once."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def bench_retriever() -> ModuleType:
    """bench/retriever.py as the module `bench_retriever`."""
    return load_path("bench_retriever", ROOT / "bench" / "retriever.py")


def pg_cluster() -> ModuleType:
    """tests/utils/pg_cluster.py as the module `pg_cluster`."""
    return load_path("pg_cluster", ROOT / "tests" / "utils" / "pg_cluster.py")
