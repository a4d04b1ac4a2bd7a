"""What the idempotency suite's checks share: the ids they use and claim helpers with
defaults, so each check names only what it is about."""

from __future__ import annotations

from tesserix_adk.stores.protocols import IdempotencyRecord, IdempotencyStore, ToolFlags

__all__ = ["G", "R", "T"]

T = "acme"
R = "run-1"
# A second tenant, for the tests that one tenant's record never reaches another's.
G = "globex"


async def _claim(
    store: IdempotencyStore,
    key: str,
    holder: str,
    *,
    tenant: str = T,
    run_id: str = R,
    iteration: int | None = 0,
    tool: str | None = "book_seat",
    call_id: str | None = "call_1",
    flags: ToolFlags | None = None,
    fence: int | None = None,
    ttl: float | None = None,
    takeover: bool = False,
) -> IdempotencyRecord:
    return await store.claim(
        key,
        holder=holder,
        tenant=tenant,
        run_id=run_id,
        iteration=iteration,
        tool=tool,
        call_id=call_id,
        flags=ToolFlags() if flags is None else flags,
        fence=fence,
        ttl=ttl,
        takeover=takeover,
    )


async def _run_claim(
    store: IdempotencyStore,
    key: str,
    holder: str,
    *,
    ttl: float,
    tenant: str = T,
    fence: int | None = None,
    takeover: bool = False,
) -> IdempotencyRecord:
    return await store.claim(
        key,
        holder=holder,
        tenant=tenant,
        run_id=R,
        iteration=None,
        tool=None,
        call_id=None,
        flags=None,
        fence=fence,
        ttl=ttl,
        takeover=takeover,
    )
