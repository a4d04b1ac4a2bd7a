"""The mark an unkeyed side-effecting call leaves in the kit's store just before it goes
out, when Temporal carries the run.

Temporal's attempt number cannot say whether such a call went out before: a reset of the
workflow starts its activity at attempt 1 again. The mark is a record with no tool (as a
cancel request is), never lapsing, under a key naming the run, the turn, the call's place
and its id; an execution that finds one an earlier attempt left refuses the call as in
doubt. A mark is dropped only by its holder, when the call was stopped after all; a mark
whose write lost its reply is read back, never assumed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging

from tesserix_adk.checkpoint.payload import Checkpoint, OutstandingCall
from tesserix_adk.checkpoint.planning import PlannedCall, ToolDisposition
from tesserix_adk.checkpoint.redaction import Masked
from tesserix_adk.errors import (
    AdkError,
    IndeterminateToolCallError,
    StoreReplyLostError,
    StoreUnavailableError,
)
from tesserix_adk.stores.protocols import IdempotencyRecord, IdempotencyStore, RecordStatus
from tesserix_adk.tools import canonical_json

__all__ = ["UnkeyedMarks", "unkeyed_in_doubt", "unkeyed_mark_key"]

_log = logging.getLogger("tesserix_adk.temporal")


def unkeyed_mark_key(tenant: str, run_id: str, iteration: int, position: int, call_id: str) -> str:
    """The idempotency key of the mark an unkeyed call leaves just before it goes out."""
    body = canonical_json(["unkeyed", tenant, run_id, iteration, position, call_id])
    return "unkeyed1:" + hashlib.sha256(body.encode("utf-8")).hexdigest()


class UnkeyedMarks:
    """``SendMarks`` for the one call of a tool activity: ``cp`` its frontier, ``position``
    its place in the turn."""

    def __init__(
        self, idempotency: IdempotencyStore, holder: str, cp: Checkpoint, position: int
    ) -> None:
        self._idempotency = idempotency
        self._holder = holder
        self._cp = cp
        self._position = position

    def _key(self, oc: OutstandingCall) -> str:
        cp = self._cp
        return unkeyed_mark_key(cp.tenant, cp.run_id, cp.iteration, self._position, oc.call.id)

    async def mark(self, oc: OutstandingCall) -> None:
        """Leave the call's mark, or refuse it as in doubt when an earlier attempt left one;
        a mark whose write lost its reply is read back, and, not found, dropped (should it
        be there after all) with the call not sent."""
        key = self._key(oc)
        try:
            rec = await self._idempotency.claim(
                key,
                holder=self._holder,
                tenant=self._cp.tenant,
                run_id=self._cp.run_id,
                iteration=None,
                tool=None,
                call_id=None,
                flags=None,
            )
        except StoreReplyLostError as exc:
            lost: Exception = exc
        except StoreUnavailableError:
            await self.unsent(oc)  # said not to have taken effect; should it have, dropped
            raise
        except AdkError:
            raise
        except Exception as exc:
            lost = exc  # a driver error the store did not translate: the outcome is unknown
        else:
            if not self._ours(rec):
                raise unkeyed_in_doubt(oc, self._cp, "an earlier execution of its workflow sent it")
            return
        found = await self._read_back(key)
        if found is not None and self._ours(found):
            return
        if found is not None:
            raise unkeyed_in_doubt(oc, self._cp, "an earlier execution of its workflow sent it")
        await self.unsent(oc)
        raise StoreUnavailableError(
            f"the mark of {oc.call.name} ({oc.call.id}) lost its reply and could not be read "
            f"back, so the call was not sent: {lost}"
        ) from lost

    async def unsent(self, oc: OutstandingCall) -> None:
        """Drop this attempt's mark of a call that did not go out (a no-op if absent or
        another's); a failure is logged, and leaves the call refused in doubt."""
        try:
            await self._idempotency.release(
                self._key(oc), tenant=self._cp.tenant, holder=self._holder, undispatched=True
            )
        except Exception as exc:
            _log.warning(
                "the mark of unsent call %s could not be dropped: %r", oc.call.id, Masked(exc)
            )

    def _ours(self, rec: IdempotencyRecord) -> bool:
        return rec.status is RecordStatus.in_flight and rec.holder == self._holder

    async def _read_back(self, key: str) -> IdempotencyRecord | None:
        with contextlib.suppress(Exception):
            found = await self._idempotency.lookup([key], tenant=self._cp.tenant)
            return found.get(key)
        return None


def unkeyed_in_doubt(
    oc: OutstandingCall,
    cp: Checkpoint,
    why: str = "an earlier attempt of its activity may have sent it",
) -> IndeterminateToolCallError:
    """The refusal of an unkeyed side-effecting call that may have gone out before."""
    doubt = PlannedCall(
        call_id=oc.call.id,
        tool=oc.call.name,
        key=None,
        disposition=ToolDisposition.indeterminate,
        reason=f"no idempotency key, and {why}",
        iteration=cp.iteration,
        arguments=oc.call.arguments,
        side_effects=oc.side_effects,
    )
    return IndeterminateToolCallError(
        f"cannot tell whether 1 call(s) ran: {doubt.describe()}; check the tool's own system",
        calls=[doubt],
    )
