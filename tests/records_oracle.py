"""The oracle of ``RecordsFrom``, for the tests of every store that offers it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from tesserix_adk.stores.protocols import IdempotencyRecord


def records_from_oracle(
    records: Iterable[IdempotencyRecord], iteration: int
) -> list[IdempotencyRecord]:
    """What ``records_from(…, iteration)`` must answer, from what ``records`` answered for
    the same run: its tool calls of ``iteration`` or later, in order, outcomes left out."""
    return [
        dataclasses.replace(r, outcome=None)
        for r in records
        if r.tool is not None and r.iteration is not None and r.iteration >= iteration
    ]
