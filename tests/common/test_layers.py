"""The layering of docs/design.md ("Data flow"), read from the source with `ast`: each part (retriever,
services, trainer) imports only itself and `sisrl.common`; `sisrl.common` imports none of the parts. bench/ and
tests/ are exempt."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("retriever", "services", "trainer")
# Imports still to move, each naming its file: an entry that no longer occurs fails the test, so the list
# can only shrink. Empty: no part imports another.
PENDING: set[tuple[str, str]] = set()


def imported_modules(tree: ast.AST) -> set[str]:
    """Absolute module names a file imports: `import`, `from ... import`, `importlib.import_module("...")`."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value)
    return names


def crossings(folder: str) -> set[tuple[str, str]]:
    """(file, other part) for every import of another part's `sisrl.<part>` from a file under `folder`."""
    found: set[tuple[str, str]] = set()
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in imported_modules(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            head = name.split(".")
            if len(head) >= 2 and head[0] == "sisrl" and head[1] in PARTS and head[1] != folder:
                found.add((path.relative_to(ROOT).as_posix(), head[1]))
    return found


def test_the_scan_sees_every_import_form() -> None:
    tree = ast.parse("import sisrl.trainer.sis\nfrom sisrl.services import store\nfrom . import x\n"
                     "def f():\n    from sisrl.retriever.cli import main\n"
                     "importlib.import_module('sisrl.services.engines.local')\n")
    assert imported_modules(tree) == {"sisrl.trainer.sis", "sisrl.services", "sisrl.retriever.cli",
                                      "sisrl.services.engines.local"}


def test_parts_import_only_themselves_and_common() -> None:
    found = set().union(*(crossings(part) for part in PARTS))
    assert found - PENDING == set(), "a part imports another part; move the shared code into common/"
    assert PENDING - found == set(), "resolved: remove these entries from PENDING"


def test_common_imports_no_part() -> None:
    assert crossings("common") == set()
