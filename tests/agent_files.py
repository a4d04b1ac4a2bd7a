"""An agent written to a file for the command line (``tesserix worker --agent file.py:agent``):
its one side-effecting call appends a line to a file the test reads."""

from __future__ import annotations

import secrets
from pathlib import Path


def booking_agent_file(tmp_path: Path, *, approval: bool = False) -> tuple[str, Path]:
    """``file.py:agent`` of an agent whose one call (``book``, approval-gated if asked)
    writes a line to a file, its module's ``PROVIDER`` asking for it once; the file."""
    sent = tmp_path / f"sent_{secrets.token_hex(4)}.txt"
    module = tmp_path / f"booking_agent_{secrets.token_hex(4)}.py"
    module.write_text(
        "from pathlib import Path\n"
        "from tesserix_adk import Agent, ScriptedProvider, tool\n"
        f"@tool(requires_approval={approval})\n"
        "def book(flight: str) -> str:\n"
        '    """Book a seat."""\n'
        f"    with Path({str(sent)!r}).open('a') as f:\n"
        "        f.write(flight + '\\n')\n"
        "    return 'booked'\n"
        'agent = Agent("booking", "Book.", [book])\n'
        'PROVIDER = ScriptedProvider([[("book", {"flight": "LH1"})], "done"])\n',
        encoding="utf-8",
    )
    return f"{module}:agent", sent
