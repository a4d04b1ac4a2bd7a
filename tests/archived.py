"""The kit as it was at an earlier commit, imported beside the current one under another
name: the oracle of the attacks that compare a change with the code it replaced."""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import math
import re
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def archived(commit: str, name: str, folder: Path) -> Iterator[Callable[[str], ModuleType]]:
    """``tesserix_adk`` at ``commit`` unpacked under ``folder`` as the package ``name`` (each
    ``tesserix_adk`` in it renamed); yields what imports one of its modules by its dotted
    path below the package. Skips where there is no git history to build it from."""
    made = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, "src/tesserix_adk"],
        capture_output=True,
        check=False,
    )
    if made.returncode != 0:
        pytest.skip(f"no git history to build the code of {commit} from: {made.stderr[:200]!r}")
    with tarfile.open(fileobj=io.BytesIO(made.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):  # 3.11.4 and later
            tar.extraction_filter = tarfile.data_filter
        tar.extractall(folder)
    package = folder / name
    (folder / "src" / "tesserix_adk").rename(package)
    for source in package.rglob("*.py"):
        text = source.read_text(encoding="utf-8")
        source.write_text(re.sub(r"\btesserix_adk\b", name, text), encoding="utf-8")
    sys.path.insert(0, str(folder))
    try:
        yield lambda module: importlib.import_module(f"{name}.{module}" if module else name)
    finally:
        sys.path.remove(str(folder))
        for loaded in [n for n in sys.modules if n.split(".")[0] == name]:
            del sys.modules[loaded]


def canonical(value: Any) -> Any:
    """A comparable form that keeps what ``==`` forgets: types (1 vs 1.0 vs True, list vs
    tuple, str vs a subclass), the sign of zero, NaN, key order, enum classes by name."""
    if isinstance(value, enum.Enum):
        return ("enum", type(value).__name__, value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # A field at None or False is left out: a field added since the archived version
        # (at that default here, absent there) compares equal, and any value set still shows.
        fields = [
            f
            for f in dataclasses.fields(value)
            if getattr(value, f.name) is not None and getattr(value, f.name) is not False
        ]
        return (
            type(value).__name__,
            tuple((f.name, canonical(getattr(value, f.name))) for f in fields),
        )
    if isinstance(value, float):
        return ("float", "nan" if math.isnan(value) else repr(value))
    if isinstance(value, int) and not isinstance(value, bool):
        # Compared without str(): a huge integer may be past the interpreter's digit limit.
        return (type(value).__name__, value.bit_length(), value % (2**61 - 1), value < 0)
    if isinstance(value, Mapping):
        items = tuple((canonical(k), canonical(v)) for k, v in value.items())
        return ("map", type(value).__name__, items)
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(canonical(v) for v in value))
    return (type(value).__name__, value)
