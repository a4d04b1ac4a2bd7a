"""The key layout of the Redis stores, and the one class that names its keys.

Every key starts with the prefix (default ``adk:``); every id is percent-encoded
(everything outside ``A-Z a-z 0-9 . _ ~ -``) before it enters a key, so ids that contain
``:``, ``{`` or ``*`` can neither collide nor change a key's meaning. All keys of a run share
the hash tag ``{<tenant>:<run>}``, so one script can decide over all of them atomically::

    adk:{acme:run-1}:cp:frontier      hash   the frontier (one key per run)
    adk:{acme:run-1}:cp:steps         hash   step -> payload    (step history, with
    adk:{acme:run-1}:cp:step-fences   hash   step -> fence       retention keep_last)
    adk:{acme:run-1}:cp:step-index    zset   the steps kept, by number
    adk:{acme:run-1}:lease            hash   holder, fence, deadline (server microseconds)
    adk:{acme:run-1}:lease:fence      string the acquisition counter; never expires, never
                                             goes back, survives release and expiry
    adk:{acme:run-1}:<store>:fence    string the highest fence each store has seen
    adk:{acme:run-1}:idem:rec:<key>   hash   one idempotency record
    adk:{acme:run-1}:idem:keys        set    the records of the run
    adk:{acme:run-1}:idem:iter        zset   the same records by iteration (-inf: none), so
                                             planning reads only the latest ones
    adk:{acme:run-1}:history:items    list   the transcript (appends push only new items)
    adk:{acme:run-1}:history:digests  list   chained digest of each prefix
    adk:{acme:run-1}:ledger           hash   micros and tokens
    adk:{acme:run-1}:approval:<id>    hash   one approval request
    adk:idem-key:{<tenant>:<key>}     string which run of the tenant holds a record
    adk:approval-id:{<id>}            string which run holds a request (lookup by id)
    adk:{acme:run-1}:work             hash   the run's work entry: tenant, run_id, agent,
                                             state, since, not_before (server
                                             microseconds), attempts, reason, input
    adk:work:due:decided              zset   run tag -> since: the due index, one sorted
    adk:work:due:wanted               zset   set per take order, so finding work reads
    adk:work:due:submitted            zset   only their heads (parked, done: in none)
    adk:work:delayed                  zset   run tag -> not_before: runs backing off
    adk:work:runs                     zset   run tag -> since: every entry, done too

No key that holds a fence or a record ever has a TTL.

On a Redis Cluster every script runs on the node of the run's slot. Two kinds of key are
not per run, and each is only ever read or written on its own, never in a script beside a
run's keys: ``idem-key:{<tenant>:<key>}`` (which run holds a record) and
``approval-id:{<id>}`` (which run holds a request). The one exception is a custom
idempotency key that two runs of a tenant claim: the record lives under the first run's
tag, the fences under the second's, and a cluster refuses that script (``CROSSSLOT``,
reported as a ``ConfigurationError``).

The work index keys (``adk:work:*``) are global, one per server, and the scripts that find
work read each candidate's ``:work`` and ``:lease`` hash by a name built from its tag, keys
they cannot declare in ``KEYS``. That is sound on one server, so a cluster's stores have no
work index (``Stores.work`` is ``None``). A cluster would need a hash tag scheme for them
(the due index split by slot, say ``adk:{work:<n>}:due:*`` with runs placed in a shard's
slot by their tag, and a lease mirror or a per-shard scan) before these scripts can run
there.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

from tesserix_adk.errors import ConfigurationError

__all__ = ["DEFAULT_PREFIX"]

DEFAULT_PREFIX = "adk:"


def _enc(value: str) -> str:
    """``value`` as it enters a key."""
    # quote() keeps exactly A-Z a-z 0-9 and "_.-~" with safe="", and encodes UTF-8.
    return quote(value, safe="")


def _glob_escape(value: str) -> str:
    """``value`` matched literally in a ``SCAN`` pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in value)


def _check_prefix(prefix: str) -> str:
    if "{" in prefix or "}" in prefix:
        # A brace in the prefix would become the hash tag and split a run across slots.
        raise ConfigurationError(f"a Redis key prefix may not contain braces, got {prefix!r}")
    return prefix


@dataclass(frozen=True, slots=True)
class _Keys:
    """Names every key of the layout drawn in the module docstring."""

    prefix: str

    def __post_init__(self) -> None:
        _check_prefix(self.prefix)

    @staticmethod
    def tag(tenant: str, run_id: str) -> str:
        return f"{_enc(tenant)}:{_enc(run_id)}"

    def run(self, tenant: str, run_id: str, name: str) -> str:
        return self.tagged(self.tag(tenant, run_id), name)

    def tagged(self, tag: str, name: str) -> str:
        return f"{self.prefix}{{{tag}}}:{name}"

    def key_index(self, tenant: str, key: str) -> str:
        return f"{self.prefix}idem-key:{{{_enc(tenant)}:{_enc(key)}}}"

    def legacy_key_index(self, key: str) -> str:
        # Written by kits before records were keyed by (tenant, key); still read, never
        # written, so that an upgrade finds every record those kits left.
        return f"{self.prefix}idem-key:{{{_enc(key)}}}"

    def approval_index(self, id: str) -> str:
        return f"{self.prefix}approval-id:{{{_enc(id)}}}"

    def work(self, name: str) -> str:
        """A key of the work index (``due:<state>``, ``delayed``, ``runs``)."""
        return f"{self.prefix}work:{name}"
