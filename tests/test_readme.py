"""Every code block of README.md runs as written, so the README cannot drift from the kit.

The blocks run in order, in one throwaway directory laid out like a fresh clone (its
``examples/``, and ``.venv`` pointing at this interpreter's environment), as a reader who
follows the README from the top would run them:

- ``sh``/``bash``: each block in ``bash -euo pipefail``, the venv's ``bin`` first on ``PATH``
  (as after ``. .venv/bin/activate``); it must exit 0.
- ``console``: each ``$ `` line as a command, the same way.
- ``python`` after ``<!-- file: NAME -->``: written to NAME in that directory (later blocks
  run or import it).
- ``python`` with ``asyncio.run(`` or ``__main__``: a complete program, run as a script.
- any other ``python``: a step of the session the README opens (``python -m asyncio``: one
  namespace, top-level ``await``), on one event loop.
- ``text``: output, a synopsis or a layout; nothing to run.

A block that cannot run here says so right above it, ``<!-- not-run: why -->``; the reasons
are pinned below, so a new one is a decision, not an accident. One setup is shared by every
block (the directory, the session), so the whole README costs a few seconds.
"""

from __future__ import annotations

import ast
import asyncio
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"

_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_MARK = re.compile(r"^\s*<!--\s*(not-run|file):\s*(.*?)\s*-->\s*$")
RUNNABLE = {"python", "sh", "bash", "console"}
NOT_CODE = {"text"}

# Every block the suite does not run, by the reason the README gives for it.
NOT_RUN = {
    "clones from the network: the test directory is laid out like the clone",
    "creates .venv and installs; tests/cli/test_cli.py runs the demo, make test is the suite",
    "installs from the network",
    "needs a model server of your own (or an API key)",
    "needs an MCP server script of your own (tests/mcp_tools runs a real one)",
    "needs a Temporal server (tests/on_temporal runs a real one)",
    "serves until stopped (tests/console runs it)",
}


@dataclass(frozen=True)
class Block:
    line: int
    lang: str
    text: str
    not_run: str | None = None
    file: str | None = None

    @property
    def id(self) -> str:
        return f"README.md:{self.line}:{self.lang}"


def readme_blocks() -> list[Block]:
    lines = README.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opened = _FENCE.match(lines[i])
        if opened is None:
            i += 1
            continue
        marks: dict[str, str] = {}
        j = i - 1
        while j >= 0 and (m := _MARK.match(lines[j])) is not None:
            marks[m[1]] = m[2]
            j -= 1
        indent = len(opened[1])  # a block inside a list item is indented with it
        end = i + 1
        while not lines[end].strip().startswith("```"):
            end += 1
        blocks.append(
            Block(
                line=i + 1,
                lang=opened[2],
                text="\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n",
                not_run=marks.get("not-run"),
                file=marks.get("file"),
            )
        )
        i = end + 1
    return blocks


BLOCKS = readme_blocks()


def test_every_block_says_what_it_is() -> None:
    unlabeled = [b.id for b in BLOCKS if b.lang not in RUNNABLE | NOT_CODE]
    assert not unlabeled, "label each fence python, sh, console or text"


def test_every_block_not_run_says_why_and_the_reasons_are_pinned() -> None:
    reasons = {b.not_run for b in BLOCKS if b.not_run is not None}
    assert reasons == NOT_RUN
    skipped = [b for b in BLOCKS if b.not_run is not None]
    assert len(skipped) == len(NOT_RUN), "each reason stands for one block"
    ran = [b for b in BLOCKS if b.lang in RUNNABLE and b.not_run is None]
    assert len(ran) > 2 * len(skipped), "most of the README runs"


def test_every_example_file_is_run_by_a_test() -> None:
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    for example in (ROOT / "examples").glob("*.py"):
        assert example.name in tests, f"no test runs examples/{example.name}"


@dataclass
class Session:
    """The clone-like directory and the Python session the README's blocks share."""

    workdir: Path
    env: dict[str, str]
    runner: asyncio.Runner
    namespace: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    workdir = tmp_path_factory.mktemp("clone")
    shutil.copytree(ROOT / "examples", workdir / "examples")
    (workdir / ".venv").symlink_to(sys.prefix)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADK_") and k != "PYTHONPATH"}
    env["PATH"] = f"{workdir / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(workdir / ".venv")
    before = os.getcwd()
    os.chdir(workdir)
    sys.path.insert(0, str(workdir))
    modules = set(sys.modules)
    try:
        with asyncio.Runner() as runner:
            ns: dict[str, Any] = {"__name__": "__readme__"}
            yield Session(workdir=workdir, env=env, runner=runner, namespace=ns)
            stores = ns.get("stores")
            if stores is not None:
                runner.run(stores.aclose())
    finally:
        os.chdir(before)
        sys.path.remove(str(workdir))
        for name in set(sys.modules) - modules:  # the README's own modules (my_agent, ...)
            module = sys.modules[name]
            if str(workdir) in str(getattr(module, "__file__", "") or ""):
                del sys.modules[name]


def _shell(session: Session, command: str, block: Block) -> None:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", command],
        cwd=session.workdir,
        env=session.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"{block.id} exited {done.returncode}:\n{command}\n" + (
        done.stdout + done.stderr
    )


def _python_session(session: Session, block: Block) -> None:
    code = compile(
        block.text, block.id, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True
    )
    result = eval(code, session.namespace)
    if asyncio.iscoroutine(result):
        session.runner.run(result)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in RUNNABLE], ids=lambda b: b.id)
def test_readme_block_runs(session: Session, block: Block) -> None:
    if block.not_run is not None:
        pytest.skip(f"not run: {block.not_run}")
    if block.lang in ("sh", "bash"):
        _shell(session, block.text, block)
    elif block.lang == "console":
        for line in block.text.splitlines():
            if line.startswith("$ "):
                _shell(session, line[2:], block)
    elif block.file is not None:
        (session.workdir / block.file).write_text(block.text)
    elif "asyncio.run(" in block.text or "__main__" in block.text:
        script = session.workdir / f"readme_{block.line}.py"
        script.write_text(block.text)
        _shell(session, f"python {script.name}", block)
    else:
        _python_session(session, block)
