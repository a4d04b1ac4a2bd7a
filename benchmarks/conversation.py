"""The one conversation every backend and peer in ``benchmarks/turns.py`` carries.

One turn is an assistant message with one tool call of ~500 characters of arguments, then
that call's ~500-character result. The text is deterministic (seeded), so every framework
writes the same content and bytes compare like with like.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from functools import lru_cache

TOOL = "lookup"
QUESTION = "Find me everything about order 4711."
ANSWER = "Here is everything I found."


def _text(rng: random.Random, n: int) -> str:
    words = []
    size = 0
    while size < n:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:n]


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn's content: the call's arguments and the tool's result."""

    index: int
    arguments: dict[str, object]
    result: str

    @property
    def call_id(self) -> str:
        return f"call_{self.index}"

    def assistant_json(self) -> bytes:
        """The assistant message as a plain JSON document (what the floors write)."""
        call = {"id": self.call_id, "name": TOOL, "arguments": self.arguments}
        return json.dumps({"role": "assistant", "content": "", "tool_calls": [call]}).encode()

    def result_json(self) -> bytes:
        """The tool message as a plain JSON document (what the floors write)."""
        doc = {"role": "tool", "content": self.result, "tool_call_id": self.call_id}
        return json.dumps(doc).encode()


# 64 distinct turns, repeated: long runs stay cheap to build and the bytes stay the same.
_DISTINCT = 64


@lru_cache(maxsize=1)
def _pool() -> tuple[tuple[str, str], ...]:
    rng = random.Random(7)
    return tuple((_text(rng, 480), _text(rng, 500)) for _ in range(_DISTINCT))


def turn(index: int) -> Turn:
    """Turn ``index`` (0-based): its arguments name the turn, so no two calls are alike."""
    query, result = _pool()[index % _DISTINCT]
    return Turn(index=index, arguments={"query": query, "page": index}, result=result)
