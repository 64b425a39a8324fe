"""`manifest.json`: what an index directory holds and how it was made; written last, so its presence marks a
complete index. Serving checks it against the encoder it loads and refuses a mismatch at start-up."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sisrl.common.atomic import write_json

MANIFEST_FILE = "manifest.json"
FORMAT = "sisrl-retriever-index/1"
FAISS_FILE = "index.faiss"
DOCS_FILE = "docs.jsonl"
# Where a build keeps each file; `Manifest.files` overrides them for an imported index (retriever/prebuilt.py),
# whose FAISS file and corpus stay where they were made.
BUILT_FILES = {"faiss": FAISS_FILE, "docs": DOCS_FILE}
# Identity keys that describe how an encoder runs, not what vectors it makes: they may differ between build and
# serve (e.g. build in bf16 on a GPU, serve in fp32 on a CPU).
RUNTIME_KEYS = frozenset({"dtype", "device", "batch_size"})


class ManifestError(ValueError):
    """A manifest that is missing, unreadable, incomplete, or does not match the encoder or files."""


@dataclass(frozen=True)
class EncoderSpec:
    """The EncoderConfig fields that decide the vectors; enough to rebuild the encoder at serve time."""

    model: str
    query_prefix: str | None
    passage_prefix: str | None
    max_length: int


@dataclass(frozen=True)
class Manifest:
    encoder: EncoderSpec
    encoder_identity: dict[str, str | int | bool]
    dim: int
    count: int
    index_type: str
    index_params: dict[str, int]
    corpus_path: str
    corpus_sha256: str
    corpus_skipped_lines: int
    build_dtype: str | None = None  # the dtype the passages were encoded in (`auto` resolved); None: older index
    build_backend: str | None = None  # the encoder runtime of the build (torch | onnx); None: older index
    normalized: bool = True
    metric: str = "inner_product"
    format: str = FORMAT
    files: dict[str, str] = field(default_factory=lambda: {"faiss": FAISS_FILE})

    def save(self, directory: Path) -> None:
        write_json(directory / MANIFEST_FILE, asdict(self))

    def path(self, directory: Path, role: str) -> Path:
        """Where the index in `directory` keeps its `role` file (`faiss` | `docs`): `files[role]`, absolute or
        relative to `directory`, else the build's own name."""
        return directory / self.files.get(role, BUILT_FILES[role])


def load_manifest(directory: Path) -> Manifest:
    """Read and validate `directory/manifest.json`; raise ManifestError naming what is wrong."""
    path = directory / MANIFEST_FILE
    if not path.is_file():
        raise ManifestError(f"no index at {str(directory)!r}: {MANIFEST_FILE} is missing (run `sisrl-retriever build`)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: not valid JSON ({exc}); rebuild the index") from exc
    if not isinstance(raw, dict):
        raise ManifestError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    if raw.get("format") != FORMAT:
        raise ManifestError(f"{path}: format is {raw.get('format')!r}, expected {FORMAT!r}")
    try:
        encoder = EncoderSpec(**raw.pop("encoder"))
        manifest = Manifest(encoder=encoder, **raw)
    except (KeyError, TypeError) as exc:
        raise ManifestError(f"{path}: missing or unexpected field ({exc}); rebuild the index") from exc
    _check_types(manifest, path)
    return manifest


def _check_types(manifest: Manifest, path: Path) -> None:
    expected: dict[str, type | tuple[type, ...]] = {
        "dim": int, "count": int, "index_type": str, "corpus_sha256": str, "normalized": bool,
        "encoder_identity": dict, "index_params": dict, "files": dict,
    }
    for name, kind in expected.items():
        value = getattr(manifest, name)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ManifestError(f"{path}: field {name!r} = {value!r} is not a {getattr(kind, '__name__', kind)}")
    if not all(isinstance(k, str) and isinstance(v, str) and k in BUILT_FILES for k, v in manifest.files.items()):
        raise ManifestError(f"{path}: field 'files' = {manifest.files!r} is not a map of {sorted(BUILT_FILES)} to paths")
    if manifest.dim <= 0 or manifest.count < 0:
        raise ManifestError(f"{path}: dim={manifest.dim}, count={manifest.count} are not a valid index size")
    if manifest.metric != "inner_product" or not manifest.normalized:
        raise ManifestError(f"{path}: metric={manifest.metric!r} normalized={manifest.normalized}; "
                            "only L2-normalised inner product is supported")


def identity_mismatch(manifest_identity: dict[str, Any], encoder_identity: dict[str, Any]) -> list[str]:
    """The identity keys (runtime keys aside) whose values differ, as 'key: index=A, encoder=B' lines."""
    keys = sorted((set(manifest_identity) | set(encoder_identity)) - RUNTIME_KEYS)
    return [
        f"{key}: index={manifest_identity.get(key)!r}, encoder={encoder_identity.get(key)!r}"
        for key in keys
        if manifest_identity.get(key) != encoder_identity.get(key)
    ]
