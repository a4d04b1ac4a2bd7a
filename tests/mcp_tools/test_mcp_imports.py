"""The MCP toolset costs nothing to those who do not use it: importing the kit imports no
MCP SDK, and without the SDK ``tesserix_adk.mcp`` says what to install."""

from __future__ import annotations

import subprocess
import sys

WITHOUT_THE_SDK = """
import importlib.abc, sys

class NoMcp(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "mcp" or name.startswith(("mcp.", "mcp_types")):
            raise ImportError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, NoMcp())
import tesserix_adk
try:
    import tesserix_adk.mcp
except ImportError as exc:
    print("ImportError:", exc)
"""


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_importing_the_kit_imports_no_mcp_sdk() -> None:
    out = _python(
        "import sys, tesserix_adk; print(sorted(m for m in sys.modules if m.split('.')[0] "
        "in ('mcp', 'mcp_types')))"
    )
    assert out.strip() == "[]"


def test_without_the_sdk_the_mcp_package_names_the_extra_to_install() -> None:
    out = _python(WITHOUT_THE_SDK)
    assert 'pip install "tesserix-adk[mcp]"' in out
