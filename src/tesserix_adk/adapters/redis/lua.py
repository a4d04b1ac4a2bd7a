"""The stores' Lua scripts: one file each under ``scripts/``, registered on a client.

Time that decides anything is the server's ``TIME``, read inside the script that decides:
key expiry is frozen for the length of a script, so ttl claims and leases keep their
deadline as data and compare it with ``TIME``. Fenced writes are decided inside one script
each, which compares the write's fence with the highest the store has seen *and* with the
run's current lease fence, so a takeover fences the old holder out at once.

Each file starts with a header naming its ``KEYS`` and ``ARGV``; ``common.lua``, the
functions they share, is prepended to every one. A store registers its scripts when it is
built (``register_script``: run with ``EVALSHA``, loaded again on ``NOSCRIPT``).

Resends: redis-py sends a command again when its reply was lost, so every script must give
the same answer when run twice. Most do by their nature; a lease acquisition and a ledger
charge carry a random token per call, so the second run recognises the first.
"""

from __future__ import annotations

from importlib.resources import files

from tesserix_adk.adapters.redis.connection import AsyncScript, Client

__all__ = ["register"]

_COMMON = "common"


def _read(name: str) -> str:
    # Package data: the files ship in the wheel beside this module.
    script = files("tesserix_adk.adapters.redis").joinpath("scripts", f"{name}.lua")
    return script.read_text(encoding="utf-8")


def register(client: Client, *names: str) -> tuple[AsyncScript, ...]:
    """The scripts ``scripts/<name>.lua``, each after the common prelude, on ``client``."""
    common = _read(_COMMON)
    return tuple(client.register_script(common + _read(name)) for name in names)
