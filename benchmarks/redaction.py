"""Redaction throughput on ordinary and hostile inputs: figures, never asserts.

    python benchmarks/redaction.py [--quick] [--size-kib 256]

For each input the best of a few runs is timed at size N and 4N, in this one process; the
table gives MB/s at 4N and the time ratio t(4N)/t(N), which stays near 4 for a linear pattern
(a quadratic one shows 16). The last line says how large a string can be redacted on the
event loop within 5 ms on this machine, which is where a caller should hand redaction to a
worker thread instead (``await asyncio.to_thread(redactor.text, s)``).
"""

from __future__ import annotations

import argparse
import json
import random
import string
import time
from collections.abc import Callable

from tesserix_adk.checkpoint.redaction import Redactor

Build = Callable[[int], str]


def _fill(unit: str, size: int) -> str:
    return unit * max(1, size // len(unit))


def _prose(size: int) -> str:
    rng = random.Random(7)
    words: list[str] = []
    total = 0
    while total < size:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
        words.append(word)
        total += len(word) + 1
        if rng.random() < 0.02:
            words.append("token: abc123, see https://example.com/a?page=2\n")
    return " ".join(words)[:size]


def _json_result(size: int) -> str:
    rng = random.Random(11)
    rows = []
    total = 0
    while total < size:
        row = {
            "id": rng.randint(1, 10**6),
            "name": "".join(rng.choice(string.ascii_letters) for _ in range(12)),
            "email": "ann@example.com",
            "password": "hunter2",
            "tags": ["a", "b"],
        }
        rows.append(row)
        total += 110
    return json.dumps({"rows": rows})


def _log_lines(size: int) -> str:
    line = (
        "2024-05-01T12:00:00Z ERROR provider call failed: 401 "
        "{'error': 'invalid api key', 'x-api-key': 'abc123'} Authorization: Bearer abc\n"
    )
    return _fill(line, size)


ORDINARY: dict[str, Build] = {
    "prose": _prose,
    "json tool result": _json_result,
    "log lines": _log_lines,
}

HOSTILE: dict[str, Build] = {
    "reported: http://x/ + a.a.a…": lambda n: "http://x/ " + _fill("a.", n),
    "scheme run glued to a url": lambda n: _fill("a.", n) + "x://u:pw@h",
    "many @ after a user": lambda n: "s://u:" + _fill("a@", n),
    "PEM begin, wrong ends": lambda n: (
        "-----BEGIN A PRIVATE KEY-----\n" + _fill("-----END B PRIVATE KEY-----\n", n)
    ),
    "bearer words": lambda n: _fill("bearer ", n),
    "base64 run": lambda n: _fill("aA1/", n),
    "sensitive keys without values": lambda n: _fill("Token: ", n),
    "pydantic lines": lambda n: _fill("x\n  [type=t, input_value=", n),
    "open brackets": lambda n: _fill("[", n),
    "json with a huge token": lambda n: '{"token": "' + _fill("a", n) + '"}',
    "wrapped key lines": lambda n: "sk-" + "proj-" + "Ab3" * 10 + _fill("\nxY7Qa1", n),
    # Escapes before keys (the look-behinds that excuse an escape's end).
    "escaped key prefixes": lambda n: _fill("\\nsk-", n),
    "escaped password keys": lambda n: _fill("\\x0bpassword=", n),
    "escaped unicode before keys": lambda n: _fill("\\u201csk-aaaa\\n", n),
    "backslash runs": lambda n: _fill("\\\\\\\\n", n),
    # Keys glued to a word, and lists or objects under a credential key.
    "glued key prefixes": lambda n: _fill("xsk-" + "proj-aA1 ", n),
    "lists under keys": lambda n: _fill('{"token": ["a", {"b": "]"}]} ', n),
    "lists under keys, never closed": lambda n: _fill('password: ["a[', n),
    "prose brackets under keys": lambda n: _fill("password: [Don't {{ x }} ", n),
    # Quoted names and commas (the pair rule), and key ids before separators (a key pair).
    "quoted names and commas": lambda n: _fill("'token', ", n),
    "quoted password, spaces": lambda n: _fill("'password'," + " " * 16, n),
    "escaped quoted names": lambda n: _fill('\\"token\\", \\"', n),
    "key ids and separators": lambda n: _fill('AKIAIOSFODNN7EXAMPLE", |\n', n),
}


def _best(redactor: Redactor, text: str, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        redactor.text(text)
        best = min(best, time.perf_counter() - start)
    return best


def _row(redactor: Redactor, name: str, build: Build, size: int, repeats: int) -> float:
    small = _best(redactor, build(size // 4), repeats)
    big_text = build(size)
    big = _best(redactor, big_text, repeats)
    rate = len(big_text) / big / 1e6
    ratio = big / small if small > 0 else float("nan")
    print(f"  {name:34} {rate:9.1f} MB/s  {big * 1e3:8.2f} ms  t(4N)/t(N) {ratio:5.1f}")
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller inputs, fewer runs")
    parser.add_argument("--size-kib", type=int, default=None, help="N·4 in KiB (default 1024)")
    args = parser.parse_args()
    size_kib = args.size_kib or (256 if args.quick else 1024)
    repeats = 2 if args.quick else 5
    size = size_kib * 1024
    redactor = Redactor()
    print(f"redaction, best of {repeats}, 4N = {size_kib} KiB (N = {size_kib // 4} KiB)")
    print("ordinary inputs:")
    rates = [_row(redactor, n, b, size, repeats) for n, b in ORDINARY.items()]
    print("hostile inputs:")
    rates += [_row(redactor, n, b, size, repeats) for n, b in HOSTILE.items()]
    slowest = min(rates)
    on_loop = int(slowest * 1e6 * 0.005)
    print(
        f"slowest {slowest:.1f} MB/s: within 5 ms on the loop up to {on_loop // 1024} KiB; "
        "redact larger payloads in a worker thread"
    )


if __name__ == "__main__":
    main()
