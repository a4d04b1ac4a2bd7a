"""``Checkpointer.from_stores``: the checkpointer over an ``open_stores`` bundle."""

from __future__ import annotations

from tesserix_adk import Checkpointer, CheckpointPolicy
from tesserix_adk.stores import open_stores


async def test_from_stores_wires_the_bundles_checkpoints_and_history() -> None:
    policy = CheckpointPolicy()
    async with open_stores("memory://") as stores:
        checkpointer = Checkpointer.from_stores(
            stores, policy=policy, max_bytes=4096, redact=False, extra_patterns=["tok_[0-9]+"]
        )
        assert checkpointer.store is stores.checkpoints
        assert checkpointer.history is stores.history
        assert checkpointer.policy is policy
        assert checkpointer.max_bytes == 4096
        assert (
            checkpointer.redactor
            == Checkpointer(
                stores.checkpoints, redact=False, extra_patterns=["tok_[0-9]+"]
            ).redactor
        )
        default = Checkpointer.from_stores(stores)
        assert default.redactor == Checkpointer(stores.checkpoints).redactor
