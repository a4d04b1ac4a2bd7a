"""A tenant's work index entries as the operators' listings read them (the CLI's runs and
the console's): one damaged entry (a hand edit, a bad restore) names its run and hides no
other run, since an operator at night needs the rest of the list most."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from tesserix_adk.checkpoint.redaction import default_redactor
from tesserix_adk.errors import CheckpointCorruptError
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.protocols import WorkItem, WorksAroundDamage, WorkState

__all__ = ["damage", "parked_entries", "shown_entry"]


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


async def parked_entries(
    stores: Stores, tenant: str, run_ids: Collection[str]
) -> tuple[dict[str, WorkItem], dict[str, str]]:
    """The tenant's parked entries by run, and why the entries of any of ``run_ids`` that
    cannot be read cannot be: from listings that go on past damage (``WorksAroundDamage``);
    from an index without, one listing of the parked when every entry reads, else each of
    ``run_ids`` read alone (``WorkIndex.entry``), so the damage is named where it is."""
    if stores.work is None:
        return {}, {}
    if isinstance(stores.work, WorksAroundDamage):
        # Every state: a damaged entry is its run's whatever state it was in.
        waiting = await stores.work.listing(tenant)
        done = await stores.work.listing(tenant, state=WorkState.done)
        wanted = set(run_ids)
        return (
            {i.run_id: shown_entry(i) for i in waiting.items if i.state is WorkState.parked},
            {
                d.run_id: f"its work index entry cannot be read: {damage(d.why)}"
                for d in (*waiting.damaged, *done.damaged)
                if d.run_id in wanted
            },
        )
    try:
        parked = await stores.work.items(tenant, state=WorkState.parked)
    except CheckpointCorruptError:
        pass
    else:
        return {i.run_id: shown_entry(i) for i in parked}, {}
    found: dict[str, WorkItem] = {}
    damaged: dict[str, str] = {}
    for run_id in run_ids:
        try:
            item = await stores.work.entry(tenant, run_id)
        except CheckpointCorruptError as exc:
            damaged[run_id] = f"its work index entry cannot be read: {damage(exc)}"
            continue
        if item is not None and item.state is WorkState.parked:
            found[run_id] = shown_entry(item)
    return found, damaged
