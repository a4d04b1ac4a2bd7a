"""``Stores``: the six stores of one backend, opened together by ``open_stores(url)``.

Stores know nothing of the ``Checkpointer`` built over them: that is
``Checkpointer.from_stores(stores)``, so ``checkpoint`` depends on ``stores`` and never the
other way round.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, fields
from types import TracebackType

from tesserix_adk.stores.protocols import (
    ApprovalStore,
    CheckpointStore,
    HistoryStore,
    IdempotencyStore,
    LeaseStore,
    Ledger,
    WorkIndex,
)

__all__ = ["Stores"]


@dataclass(kw_only=True)
class Stores:
    """Every store a runner needs, from one backend.

    ``open_stores`` does no I/O; ``create_schema()`` applies the backend's schema (where it
    has one) and ``aclose()`` (or ``async with``) closes its connections.
    """

    checkpoints: CheckpointStore
    idempotency: IdempotencyStore
    leases: LeaseStore
    history: HistoryStore
    ledger: Ledger
    approvals: ApprovalStore
    # The runs that want a worker (``tesserix worker``); ``None`` on a backend without one.
    work: WorkIndex | None = None
    url: str = field(default="", repr=False)  # shown by __repr__ with its password masked
    on_create_schema: Callable[[], Awaitable[None]] | None = field(default=None, repr=False)
    on_verify: Callable[[], Awaitable[None]] | None = field(default=None, repr=False)
    on_close: Sequence[Callable[[], Awaitable[None]]] = field(default=(), repr=False)
    schema: str | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        # A URL can hold a password; ``urls`` builds on this module, so it is imported here.
        from tesserix_adk.stores.urls import redact_url

        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr)
        return f"Stores({shown}, url={redact_url(self.url)!r})"

    async def create_schema(self) -> None:
        """Apply the backend's schema; idempotent. A no-op for backends without one."""
        if self.on_create_schema is not None:
            await self.on_create_schema()

    async def verify(self) -> None:
        """Check the schema is there and current (``ConfigurationError`` if not)."""
        if self.on_verify is not None:
            await self.on_verify()

    async def aclose(self) -> None:
        """Close every connection the stores opened."""
        for close in self.on_close:
            await close()

    async def __aenter__(self) -> Stores:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
