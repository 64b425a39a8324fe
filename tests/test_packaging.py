"""Install by part: the `retriever` extra (the Docker image's install) pulls nothing of the trainer, and it
provides every third-party module the retriever and `sisrl.common` import. Read from the installed metadata
of sisrl and of each dependency, so no second environment is built."""

from __future__ import annotations

import ast
import importlib.metadata as md
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
TRAINER_ONLY = {"trl", "matplotlib", "tensorboard", "gguf"}
# trainer/plugins run inside these frameworks, which the user installs (the `trl` extra, docs/plugins.md).
PLUGIN_FRAMEWORKS = {"trl", "verl", "ray"}


def installed(name: str) -> md.Distribution | None:
    # The source tree may hold a stale `sisrl.egg-info` (a setuptools build artifact) that would shadow the
    # installed metadata when the checkout is on sys.path, so the checkout is left out of the search.
    path = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
    return next(iter(md.distributions(name=name, path=path)), None)


def requirements(dist: md.Distribution, extras: set[str]) -> list[Requirement]:
    """`dist`'s requirements that apply with `extras` on this platform."""
    out = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
            out.append(req)
    return out


def closure(extras: set[str]) -> set[str]:
    """Canonical names of every distribution `pip install 'sisrl[EXTRAS]'` pulls in, transitively."""
    seen: dict[str, set[str]] = {}
    stack: list[tuple[str, set[str]]] = [("sisrl", extras)]
    while stack:
        name, wanted = stack.pop()
        key = canonicalize_name(name)
        if key in seen and wanted <= seen[key]:
            continue
        seen[key] = seen.get(key, set()) | wanted
        dist = installed(name)
        if dist is None:  # not installed here (e.g. a platform-only extra): a leaf
            continue
        stack.extend((req.name, set(req.extras)) for req in requirements(dist, wanted))
    return set(seen) - {"sisrl"}


def third_party_imports(*folders: str) -> set[str]:
    """Top-level names of the non-stdlib, non-sisrl modules that files under `folders` import (ast scan)."""
    names: set[str] = set()
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("sisrl", "__future__")}


def test_installed_metadata_has_the_extras_of_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    dist = installed("sisrl")
    assert dist is not None, "sisrl is not installed: run `make install`"
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert set(dist.metadata.get_all("Provides-Extra") or []) == declared, \
        "the installed sisrl metadata is stale: run `make install` (or `pip install --no-deps -e .`)"
    assert {"retriever", "gateway", "trainer", "all"} <= declared


def test_retriever_extra_pulls_nothing_of_the_trainer() -> None:
    assert closure({"retriever"}) & TRAINER_ONLY == set()
    assert TRAINER_ONLY - {"trl"} <= closure({"trainer"})  # the check can see them when they are pulled
    assert {"trl"} | closure({"all"}) <= closure({"dev"})  # `make install` (dev) still installs everything


@pytest.mark.parametrize(("extra", "folders"), [("retriever", ("retriever", "common")),
                                               ("gateway", ("services", "common")),
                                               ("trainer", ("trainer", "common"))])
def test_each_extra_provides_every_module_its_part_imports(extra: str, folders: tuple[str, ...]) -> None:
    provided = closure({extra})
    providers = md.packages_distributions()
    missing = {}
    for module in sorted(third_party_imports(*folders) - PLUGIN_FRAMEWORKS):
        dists = {canonicalize_name(d) for d in providers.get(module, [])}
        if not dists & provided:
            missing[module] = sorted(dists) or ["(not installed)"]
    assert missing == {}, f"add these to the base or the {extra} extra in pyproject.toml"


def test_every_package_folder_is_listed_for_setuptools() -> None:
    """A non-editable install (the Docker image) ships only the listed packages."""
    tomllib = pytest.importorskip("tomllib")
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {f"sisrl.{name}": folder for name, folder in
               ((k.removeprefix("sisrl."), v) for k, v in tool["package-dir"].items())}
    found = {name + "".join("." + part for part in init.parent.relative_to(ROOT / folder).parts)
             for name, folder in folders.items() for init in (ROOT / folder).rglob("__init__.py")}
    assert found == set(tool["packages"])


def _declared_closure(extras: dict[str, list[str]], names: set[str]) -> set[str]:
    """Canonical names of the requirements that `sisrl[NAMES]` declares, following `sisrl[...]` self-references."""
    out: set[str] = set()
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for text in extras[name]:
            req = Requirement(text)
            if canonicalize_name(req.name) == "sisrl":
                todo.extend(req.extras)
            else:
                out.add(canonicalize_name(req.name))
    return out


def test_no_set_of_extras_installs_two_faiss_builds() -> None:
    """faiss-cpu and faiss-gpu both install the module `faiss`: asked for together, one overwrites the other's
    files. Every part that searches pulls faiss-cpu, so no extra may name faiss-gpu (docs/common.md)."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    everything = _declared_closure(extras, set(extras))
    assert "faiss-cpu" in everything  # the check sees faiss when it is pulled
    assert {n for n in everything if n.startswith("faiss")} == {"faiss-cpu"}
