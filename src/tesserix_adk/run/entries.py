"""A tenant's work index entries as the operators' listings read them (the CLI's runs and
the console's): one damaged entry (a hand edit, a bad restore) names its run and hides no
other run, since an operator at night needs the rest of the list most."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field

from tesserix_adk.checkpoint.redaction import default_redactor
from tesserix_adk.errors import CheckpointCorruptError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import WorkItem, WorksAroundDamage, WorkState

__all__ = ["TenantEntries", "damage", "tenant_entries", "shown_entry"]


def damage(exc: BaseException | str) -> str:
    """What a damaged row's error says, redacted: it quotes the row's values, which may be
    anything a hand edit or a bad restore put there."""
    return default_redactor().text(str(exc))


def shown_entry(item: WorkItem) -> WorkItem:
    """``item`` as operators are shown it: its reason redacted. The kit's workers write
    reasons redacted; another writer of the index (a script, a hand edit) may not have."""
    if not item.reason:
        return item
    return dataclasses.replace(item, reason=default_redactor().text(item.reason))


@dataclass(frozen=True, slots=True)
class TenantEntries:
    """A tenant's work index as the operators' listings read it: the parked entries by
    run; why the entries of the runs asked about that cannot be read cannot be; and the
    state of each run's entry (``None``: no work index is kept)."""

    parked: dict[str, WorkItem] = field(default_factory=dict)
    damaged: dict[str, str] = field(default_factory=dict)
    states: dict[str, WorkState] | None = None

    def taken_by_no_worker(self, run_id: str) -> bool:
        """Whether the index is kept and holds nothing a worker takes for ``run_id``: no
        entry (lost, or never written) or one marked ``done``. (A damaged entry is named
        on its own.)"""
        if self.states is None or run_id in self.damaged:
            return False
        return self.states.get(run_id, WorkState.done) is WorkState.done


async def tenant_entries(stores: Stores, tenant: str, run_ids: Collection[str]) -> TenantEntries:
    """The tenant's entries as ``TenantEntries``: from listings that go on past damage
    (``WorksAroundDamage``); from an index without, one listing of every state when every
    entry reads, else each of ``run_ids`` read alone (``WorkIndex.entry``), so the damage is
    named where it is."""
    if stores.work is None:
        return TenantEntries()
    if isinstance(stores.work, WorksAroundDamage):
        # Every state: a damaged entry is its run's whatever state it was in.
        waiting = await stores.work.listing(tenant)
        done = await stores.work.listing(tenant, state=WorkState.done)
        wanted = set(run_ids)
        return TenantEntries(
            {i.run_id: shown_entry(i) for i in waiting.items if i.state is WorkState.parked},
            {
                d.run_id: f"its work index entry cannot be read: {damage(d.why)}"
                for d in (*waiting.damaged, *done.damaged)
                if d.run_id in wanted
            },
            {i.run_id: i.state for i in (*done.items, *waiting.items)},
        )
    try:
        waiting_items = await stores.work.items(tenant)
        done_items = await stores.work.items(tenant, state=WorkState.done)
    except CheckpointCorruptError:
        pass
    else:
        return TenantEntries(
            {i.run_id: shown_entry(i) for i in waiting_items if i.state is WorkState.parked},
            {},
            {i.run_id: i.state for i in (*done_items, *waiting_items)},
        )
    parked: dict[str, WorkItem] = {}
    damaged: dict[str, str] = {}
    states: dict[str, WorkState] = {}
    for run_id in run_ids:
        try:
            item = await stores.work.entry(tenant, run_id)
        except CheckpointCorruptError as exc:
            damaged[run_id] = f"its work index entry cannot be read: {damage(exc)}"
            continue
        if item is None:
            continue
        states[run_id] = item.state
        if item.state is WorkState.parked:
            parked[run_id] = shown_entry(item)
    return TenantEntries(parked, damaged, states)
