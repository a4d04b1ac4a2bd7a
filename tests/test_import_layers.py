"""The package has no import cycle, and its layers point one way.

``stores`` knows nothing of ``checkpoint`` (the Checkpointer is built over stores, not the
other way round) but its redaction package, which imports only the error tree, and the error
tree imports no other module of the kit. A cycle shows
only when a module is imported first, so every module is imported first, each in a fresh
interpreter, with the top-level ``__init__`` (which would otherwise fix the order) out of
the way.
"""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import tesserix_adk

ROOT = Path(tesserix_adk.__file__).parent

# ``__main__`` runs the CLI when imported; the rest is imported as a user would.
MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages([str(ROOT)], prefix="tesserix_adk.")
    if not m.name.endswith(".__main__")
)

# Imports the layer rule allows, by (module, enclosing function): none.
TRANSITIONAL: set[tuple[str, str]] = set()

# The first import of each module, with the top-level package bare: its ``__init__`` is not
# run, so the named module's own imports decide the order. One interpreter that imported
# nothing of the kit forks a child per module, so every child starts as fresh as an
# interpreter as far as the kit goes; each reports its failure, traceback and all. The
# libraries the kit uses (pydantic, the drivers) are imported once, before the forks: they
# import nothing of the kit, and importing them again in every child was most of the cost.
FIRST_IMPORTS = """
import importlib, json, os, sys, traceback, types

def forked(job):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        bare = types.ModuleType("tesserix_adk")
        bare.__path__ = [root]
        sys.modules["tesserix_adk"] = bare
        try:
            said = job()
        except BaseException:
            os.write(write, traceback.format_exc().encode())
            os._exit(1)
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    return status, said

def everything():
    for module in modules:
        try:
            importlib.import_module(module)
        except BaseException:
            pass
    return json.dumps([m for m in sys.modules if m.split(".")[0] != "tesserix_adk"])

root, modules = sys.argv[1], sys.argv[2:]
_, libraries = forked(everything)
for library in json.loads(libraries or "[]"):
    try:
        importlib.import_module(library)
    except BaseException:
        pass
found = {}
for module in modules:
    status, said = forked(lambda: importlib.import_module(module) and "")
    found[module] = None if status == 0 else said or f"exit status {status}"
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def first_imports() -> dict[str, str | None]:
    """Every module's first import: ``None`` if it imported, else why not."""
    done = subprocess.run(
        [sys.executable, "-c", FIRST_IMPORTS, str(ROOT), *MODULES],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    found: dict[str, str | None] = json.loads(done.stdout)
    return found


def _import(module: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120
    )


def test_every_module_is_found() -> None:
    assert {"tesserix_adk.stores.bundle", "tesserix_adk.checkpoint.checkpointer"} <= set(MODULES)
    assert len(MODULES) > 40


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_first_in_a_fresh_interpreter(
    module: str, first_imports: dict[str, str | None]
) -> None:
    assert first_imports[module] is None, first_imports[module]


def test_a_module_that_cannot_be_imported_first_is_caught(tmp_path: Path) -> None:
    # The forking reader must report a cycle, as a fresh interpreter would.
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("from tesserix_adk.b import B\nA = 1\n")
    (package / "b.py").write_text("from tesserix_adk.a import A\nB = 2\n")
    done = subprocess.run(
        [sys.executable, "-c", FIRST_IMPORTS, str(package), "tesserix_adk.a", "tesserix_adk.b"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    found = json.loads(done.stdout)
    assert "ImportError" in found["tesserix_adk.a"] and "ImportError" in found["tesserix_adk.b"]


@pytest.mark.parametrize(
    "module",
    [
        "tesserix_adk.stores.bundle",
        "tesserix_adk.stores",
        "tesserix_adk.checkpoint",
        "tesserix_adk.checkpoint.checkpointer",
        "tesserix_adk.errors",
    ],
)
def test_the_package_imports_through_any_door(module: str) -> None:
    done = _import(module)
    assert done.returncode == 0, done.stderr


def _imports(module: str) -> list[tuple[str, str]]:
    """Every module ``module`` imports, read from its source."""
    path = ROOT.joinpath(*module.split(".")[1:])
    if path.is_dir():
        return _imports_in((path / "__init__.py").read_text(encoding="utf-8"), module)
    return _imports_in(
        path.with_suffix(".py").read_text(encoding="utf-8"), module.rpartition(".")[0]
    )


def _imports_in(source: str, package: str) -> list[tuple[str, str]]:
    """Every module ``source`` imports (absolute names, ``package`` anchoring relative
    ones), with the class or function it is in (``""`` at module level, including
    ``if TYPE_CHECKING:`` blocks); a ``from m import n`` counts both ``m`` and ``m.n``."""
    found: list[tuple[str, str]] = []

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, f"{scope}.{child.name}" if scope else child.name)
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, scope) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    anchor = ".".join(parts[: len(parts) - child.level + 1])
                    base = f"{anchor}.{base}" if base else anchor
                found.append((base, scope))
                found.extend((f"{base}.{alias.name}", scope) for alias in child.names)
            visit(child, scope)

    visit(ast.parse(source), "")
    return found


def _reaches(imported: str, target: str) -> bool:
    return imported == target or imported.startswith(target + ".")


# The redaction package sits under ``checkpoint`` but is no part of the Checkpointer: it
# imports only the error tree (checked below), and an approval store masks a decision's
# note with it, as a decision made through the store never passes the runner.
REDACTION = "tesserix_adk.checkpoint.redaction"


def test_no_store_module_imports_the_checkpoint_package() -> None:
    stores = [m for m in MODULES if _reaches(m, "tesserix_adk.stores")]
    offending = [
        (m, scope or "<module>", name)
        for m in stores
        for name, scope in _imports(m)
        if _reaches(name, "tesserix_adk.checkpoint")
        and not _reaches(name, REDACTION)
        and (m, scope) not in TRANSITIONAL
    ]
    assert len(stores) >= 5
    assert offending == []


def test_the_redaction_package_imports_only_itself_and_the_error_tree() -> None:
    modules = [m for m in MODULES if _reaches(m, REDACTION)]
    outside = [
        (m, name)
        for m in modules
        for name, _ in _imports(m)
        if _reaches(name, "tesserix_adk")
        and not _reaches(name, REDACTION)
        and not _reaches(name, "tesserix_adk.errors")
    ]
    assert len(modules) >= 3
    assert outside == []


def test_the_error_tree_imports_no_other_module_of_the_kit() -> None:
    assert [
        name for name, _ in _imports("tesserix_adk.errors") if _reaches(name, "tesserix_adk")
    ] == []


def test_the_import_reader_sees_imports_anywhere() -> None:
    # The layer checks are only as good as the reader: it must see a TYPE_CHECKING import,
    # an import inside a method, and a relative one.
    source = """
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from tesserix_adk.checkpoint.planning import PlannedCall
class Stores:
    def checkpointer(self):
        import tesserix_adk.checkpoint.checkpointer
from ..checkpoint import payload
"""
    found = _imports_in(source, "tesserix_adk.stores")
    assert ("tesserix_adk.checkpoint.planning", "") in found
    assert ("tesserix_adk.checkpoint.checkpointer", "Stores.checkpointer") in found
    assert ("tesserix_adk.checkpoint.payload", "") in found
