"""The conformance suite every ``Ledger`` passes."""

from __future__ import annotations

import pytest

from tesserix_adk.errors import StaleFenceError
from tesserix_adk.messages import Usage
from tesserix_adk.stores.protocols import FencedStore, Ledger, LedgerTotals
from tesserix_adk.testing._support import JOIN_ALIKE_IDS, ODD_IDS

__all__ = ["LedgerConformance"]

T = "acme"
R = "run-1"


def _usage(input_tokens: int, output_tokens: int) -> Usage:
    return Usage(input_tokens=input_tokens, output_tokens=output_tokens)


class LedgerConformance:
    """Subclass this in a test module to check a ``Ledger``.

    Provide one fixture (in the subclass, a conftest or the module):

    - ``ledger``: a fresh, empty ledger.
    """

    async def test_ledger_satisfies_the_protocol(self, ledger: Ledger) -> None:
        assert isinstance(ledger, Ledger)
        assert isinstance(ledger, FencedStore)

    async def test_unknown_run_has_spent_nothing(self, ledger: Ledger) -> None:
        assert await ledger.spent(T, "nobody") == 0
        assert await ledger.usage(T, "nobody") == Usage()

    async def test_charges_add_up(self, ledger: Ledger) -> None:
        await ledger.charge(T, R, 1_500, _usage(100, 20), fence=1)
        await ledger.charge(T, R, 2_600, _usage(1_100, 280), fence=1)
        assert await ledger.spent(T, R) == 4_100
        assert await ledger.usage(T, R) == _usage(1_200, 300)

    async def test_totals_read_both_figures_together(self, ledger: Ledger) -> None:
        if not isinstance(ledger, LedgerTotals):
            pytest.skip(f"{type(ledger).__name__} does not offer LedgerTotals")
        assert await ledger.totals(T, "nobody") == (0, Usage())
        await ledger.charge(T, R, 1_500, _usage(100, 20), fence=1)
        await ledger.charge(T, R, 2_600, _usage(1_100, 280), fence=1)
        assert await ledger.totals(T, R) == (4_100, _usage(1_200, 300))
        assert await ledger.totals(T, "other") == (0, Usage())

    async def test_runs_are_charged_separately(self, ledger: Ledger) -> None:
        await ledger.charge(T, "run-a", 10, _usage(1, 1))
        await ledger.charge(T, "run-b", 20, _usage(2, 2))
        assert await ledger.spent(T, "run-a") == 10
        assert await ledger.spent(T, "run-b") == 20

    async def test_stale_fence_is_refused_on_charge(self, ledger: Ledger) -> None:
        await ledger.charge(T, R, 100, _usage(10, 1), fence=2)
        with pytest.raises(StaleFenceError):
            await ledger.charge(T, R, 999, _usage(99, 9), fence=1)
        assert await ledger.spent(T, R) == 100
        assert await ledger.usage(T, R) == _usage(10, 1)

    async def test_unfenced_charges_are_accepted_before_any_fence(self, ledger: Ledger) -> None:
        await ledger.charge(T, R, 100, _usage(10, 1))
        await ledger.charge(T, R, 100, _usage(10, 1), fence=1)
        assert await ledger.spent(T, R) == 200

    async def test_unfenced_charge_is_refused_once_a_fence_was_seen(self, ledger: Ledger) -> None:
        await ledger.charge(T, R, 100, _usage(10, 1), fence=1)
        with pytest.raises(StaleFenceError):
            await ledger.charge(T, R, 999, _usage(99, 9))
        assert await ledger.spent(T, R) == 100

    async def test_seal_refuses_writes_below_it_before_any_write(self, ledger: Ledger) -> None:
        await ledger.seal(T, R, 3)
        with pytest.raises(StaleFenceError):
            await ledger.charge(T, R, 999, _usage(99, 9), fence=2)
        with pytest.raises(StaleFenceError):
            await ledger.charge(T, R, 999, _usage(99, 9))
        assert await ledger.spent(T, R) == 0
        await ledger.charge(T, R, 100, _usage(10, 1), fence=3)
        assert await ledger.spent(T, R) == 100

    async def test_seal_is_idempotent_and_never_goes_back(self, ledger: Ledger) -> None:
        await ledger.seal(T, R, 3)
        await ledger.seal(T, R, 3)
        with pytest.raises(StaleFenceError):
            await ledger.seal(T, R, 2)
        await ledger.charge(T, R, 1, _usage(1, 0), fence=4)
        with pytest.raises(StaleFenceError):
            await ledger.seal(T, R, 3)

    async def test_fences_are_kept_per_run(self, ledger: Ledger) -> None:
        await ledger.charge(T, "run-a", 1, _usage(1, 0), fence=9)
        await ledger.charge(T, "run-b", 2, _usage(2, 0), fence=1)
        assert await ledger.spent(T, "run-b") == 2

    async def test_tenants_do_not_see_each_other(self, ledger: Ledger) -> None:
        await ledger.charge("acme", R, 100, _usage(10, 1), fence=9)
        assert await ledger.spent("globex", R) == 0
        assert await ledger.usage("globex", R) == Usage()
        await ledger.charge("globex", R, 7, _usage(1, 1), fence=1)
        assert await ledger.spent("acme", R) == 100

    async def test_ids_with_odd_characters_are_kept_verbatim(self, ledger: Ledger) -> None:
        for i, tenant in enumerate(ODD_IDS):
            for j, run_id in enumerate(ODD_IDS):
                await ledger.charge(tenant, run_id, 100 * i + j, _usage(i, j), fence=1)
        for i, tenant in enumerate(ODD_IDS):
            for j, run_id in enumerate(ODD_IDS):
                assert await ledger.spent(tenant, run_id) == 100 * i + j
                assert await ledger.usage(tenant, run_id) == _usage(i, j)

    async def test_ids_that_join_alike_do_not_collide(self, ledger: Ledger) -> None:
        for i, (tenant, run_id) in enumerate(JOIN_ALIKE_IDS, start=1):
            await ledger.charge(tenant, run_id, i, _usage(i, i))
        for i, (tenant, run_id) in enumerate(JOIN_ALIKE_IDS, start=1):
            assert await ledger.spent(tenant, run_id) == i
