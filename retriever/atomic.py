"""Re-export of `sisrl.common.atomic` for the two retriever modules not yet moved onto it (index, manifest)."""

from sisrl.common.atomic import atomic_path, write_json

__all__ = ["atomic_path", "write_json"]
