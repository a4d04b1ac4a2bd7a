"""The conformance suite every ``ApprovalStore`` passes."""

from __future__ import annotations

import pytest

from tesserix_adk.errors import StaleFenceError
from tesserix_adk.messages import ToolCall
from tesserix_adk.stores.protocols import ApprovalStatus, ApprovalStore, FencedStore
from tesserix_adk.testing._support import ODD_IDS

__all__ = ["ApprovalStoreConformance"]

T = "acme"
R = "run-1"
CALLS = (
    ToolCall(id="call_1", name="book_seat", arguments={"flight": "LH123", "seats": [1, 2]}),
    ToolCall(id="call_2", name="refund", arguments={"amount": {"eur": 12.5}, "note": None}),
)


class ApprovalStoreConformance:
    """Subclass this in a test module to check an ``ApprovalStore``.

    Provide one fixture (in the subclass, a conftest or the module):

    - ``approval_store``: a fresh, empty store.
    """

    async def test_store_satisfies_the_protocol(self, approval_store: ApprovalStore) -> None:
        assert isinstance(approval_store, ApprovalStore)
        assert isinstance(approval_store, FencedStore)

    async def test_request_is_pending_with_its_calls(self, approval_store: ApprovalStore) -> None:
        request = await approval_store.request(T, R, CALLS, iteration=2, fence=1)
        assert isinstance(request.id, str) and request.id
        assert (request.tenant, request.run_id, request.iteration) == (T, R, 2)
        assert request.calls == CALLS
        assert request.status is ApprovalStatus.pending
        assert (request.by, request.note, request.decided_at) == (None, None, None)
        assert request.requested_at > 0

    async def test_get_returns_the_request(self, approval_store: ApprovalStore) -> None:
        request = await approval_store.request(T, R, CALLS, iteration=2)
        assert await approval_store.get(T, request.id) == request

    async def test_get_of_an_unknown_id_is_none(self, approval_store: ApprovalStore) -> None:
        assert await approval_store.get(T, "req-unknown") is None

    async def test_ids_are_unique(self, approval_store: ApprovalStore) -> None:
        ids = {(await approval_store.request(T, R, CALLS[:1], iteration=i)).id for i in range(100)}
        assert len(ids) == 100

    async def test_a_request_under_a_chosen_id_is_made_once(
        self, approval_store: ApprovalStore
    ) -> None:
        first = await approval_store.request(T, R, CALLS, iteration=2, fence=1, id="req-chosen")
        assert first.id == "req-chosen"
        again = await approval_store.request(T, R, CALLS, iteration=2, fence=1, id="req-chosen")
        assert again == first
        assert await approval_store.get(T, "req-chosen") == first

    async def test_a_chosen_id_returns_the_request_as_decided(
        self, approval_store: ApprovalStore
    ) -> None:
        await approval_store.request(T, R, CALLS, iteration=2, id="req-decided")
        decided = await approval_store.decide(T, "req-decided", approved=False, by="ops")
        again = await approval_store.request(T, R, CALLS, iteration=2, id="req-decided")
        assert again == decided
        assert again.status is ApprovalStatus.denied

    async def test_approval_records_who_and_when(self, approval_store: ApprovalStore) -> None:
        request = await approval_store.request(T, R, CALLS, iteration=1)
        approved = await approval_store.decide(T, request.id, approved=True, by="ops@acme")
        assert approved.status is ApprovalStatus.approved
        assert approved.by == "ops@acme"
        assert approved.note is None
        assert approved.decided_at is not None and approved.decided_at >= request.requested_at
        assert approved.calls == CALLS
        assert await approval_store.get(T, request.id) == approved

    async def test_denial_records_its_note(self, approval_store: ApprovalStore) -> None:
        request = await approval_store.request(T, R, CALLS, iteration=1)
        denied = await approval_store.decide(
            T, request.id, approved=False, by="ops@acme", note="over budget"
        )
        assert denied.status is ApprovalStatus.denied
        assert (denied.by, denied.note) == ("ops@acme", "over budget")
        assert await approval_store.get(T, request.id) == denied

    async def test_a_decisions_note_and_decider_are_kept_masked(
        self, approval_store: ApprovalStore
    ) -> None:
        # A note pasted from a log may hold a key; the runner's settings do not reach a
        # decision made through the store: it masks by the built-in patterns itself.
        key = "sk-proj-" + "Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zAb7cDe0f"
        request = await approval_store.request(T, R, CALLS, iteration=1)
        denied = await approval_store.decide(
            T, request.id, approved=False, by=f"ops {key}", note=f"the key {key} leaked"
        )
        kept = await approval_store.get(T, request.id)
        for seen in (denied, kept):
            assert seen is not None and seen.note is not None and seen.by is not None
            assert key not in seen.note and key not in seen.by
            assert seen.note.startswith("the key [redacted:") and seen.note.endswith("] leaked")
            assert seen.by.startswith("ops [redacted:")

    async def test_same_decision_again_is_a_no_op(self, approval_store: ApprovalStore) -> None:
        request = await approval_store.request(T, R, CALLS, iteration=1)
        first = await approval_store.decide(T, request.id, approved=True, by="alice", note="ok")
        again = await approval_store.decide(T, request.id, approved=True, by="bob", note="fine")
        assert again == first
        assert await approval_store.get(T, request.id) == first

    async def test_opposite_decision_is_refused(self, approval_store: ApprovalStore) -> None:
        request = await approval_store.request(T, R, CALLS, iteration=1)
        denied = await approval_store.decide(T, request.id, approved=False, by="alice")
        with pytest.raises(ValueError):
            await approval_store.decide(T, request.id, approved=True, by="bob")
        assert await approval_store.get(T, request.id) == denied

    async def test_decide_of_an_unknown_id_raises_key_error(
        self, approval_store: ApprovalStore
    ) -> None:
        with pytest.raises(KeyError):
            await approval_store.decide(T, "req-unknown", approved=True, by="alice")

    async def test_stale_fence_is_refused_on_request(self, approval_store: ApprovalStore) -> None:
        await approval_store.request(T, R, CALLS, iteration=1, fence=2)
        with pytest.raises(StaleFenceError):
            await approval_store.request(T, R, CALLS, iteration=2, fence=1)

    async def test_unfenced_requests_are_accepted_before_any_fence(
        self, approval_store: ApprovalStore
    ) -> None:
        first = await approval_store.request(T, R, CALLS, iteration=1)
        second = await approval_store.request(T, R, CALLS, iteration=2, fence=1)
        assert first.id != second.id

    async def test_unfenced_request_is_refused_once_a_fence_was_seen(
        self, approval_store: ApprovalStore
    ) -> None:
        await approval_store.request(T, R, CALLS, iteration=1, fence=1)
        with pytest.raises(StaleFenceError):
            await approval_store.request(T, R, CALLS, iteration=2)

    async def test_seal_refuses_writes_below_it_before_any_write(
        self, approval_store: ApprovalStore
    ) -> None:
        await approval_store.seal(T, R, 3)
        with pytest.raises(StaleFenceError):
            await approval_store.request(T, R, CALLS, iteration=1, fence=2)
        with pytest.raises(StaleFenceError):
            await approval_store.request(T, R, CALLS, iteration=1)
        request = await approval_store.request(T, R, CALLS, iteration=1, fence=3)
        assert request.status is ApprovalStatus.pending

    async def test_seal_is_idempotent_and_never_goes_back(
        self, approval_store: ApprovalStore
    ) -> None:
        await approval_store.seal(T, R, 3)
        await approval_store.seal(T, R, 3)
        with pytest.raises(StaleFenceError):
            await approval_store.seal(T, R, 2)
        await approval_store.request(T, R, CALLS, iteration=1, fence=4)
        with pytest.raises(StaleFenceError):
            await approval_store.seal(T, R, 3)

    async def test_decide_is_not_fenced(self, approval_store: ApprovalStore) -> None:
        request = await approval_store.request(T, R, CALLS, iteration=1, fence=1)
        await approval_store.seal(T, R, 2)
        decided = await approval_store.decide(T, request.id, approved=True, by="alice")
        assert decided.status is ApprovalStatus.approved

    async def test_fences_are_kept_per_run(self, approval_store: ApprovalStore) -> None:
        await approval_store.request(T, "run-a", CALLS, iteration=1, fence=9)
        request = await approval_store.request(T, "run-b", CALLS, iteration=1, fence=1)
        assert request.run_id == "run-b"

    async def test_tenants_do_not_see_each_other(self, approval_store: ApprovalStore) -> None:
        request = await approval_store.request("acme", R, CALLS, iteration=1, fence=9)
        assert await approval_store.get("globex", request.id) is None
        with pytest.raises(KeyError):
            await approval_store.decide("globex", request.id, approved=True, by="mallory")
        assert await approval_store.get("acme", request.id) == request
        await approval_store.request("globex", R, CALLS, iteration=1, fence=1)

    async def test_ids_with_odd_characters_are_kept_verbatim(
        self, approval_store: ApprovalStore
    ) -> None:
        made = [
            await approval_store.request(tenant, run_id, CALLS, iteration=1, fence=1)
            for tenant in ODD_IDS
            for run_id in ODD_IDS
        ]
        for request in made:
            assert await approval_store.get(request.tenant, request.id) == request
        pairs = {(r.tenant, r.run_id) for r in made}
        assert pairs == {(t, r) for t in ODD_IDS for r in ODD_IDS}
