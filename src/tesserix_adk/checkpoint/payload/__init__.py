"""The frontier (``Checkpoint``) and the one codec for every payload the kit encodes.

Four kinds of payload cross into a store, all written and read in this package: frontiers
(and step snapshots and tombstones, the same bytes), transcript entries (what a
``HistoryStore`` keeps), and recorded tool outcomes (what an ``IdempotencyStore`` keeps).
One module per concept:

- ``envelope``: the format number, the sha256 checksum every payload ends with, and the
  ``MAX_NESTING`` limit measured on the bytes before any parser runs;
- ``frontier``: the ``Checkpoint`` dataclass and the records it holds;
- ``frontier_codec``: frontiers, step snapshots and tombstones to bytes and back;
- ``transcript``: one transcript entry to bytes and back;
- ``observation``: the last turn's results, named in the transcript instead of copied;
- ``outcomes``: a tool's recorded outcome, replaced (never truncated) when too large;
- ``redacting``: the one redaction path for a tool's result;
- ``fields``: the strict readers every decoder uses.

Every decode failure is ``CheckpointCorruptError`` (or ``CheckpointFormatError``); a reader
never fills a gap with a default.
"""

from __future__ import annotations

from tesserix_adk.checkpoint.payload.envelope import (
    CHECKPOINT_FORMAT,
    DEFAULT_MAX_BYTES,
    MAX_NESTING,
    seal,
    unseal,
    within_nesting,
)
from tesserix_adk.checkpoint.payload.frontier import (
    Boundary,
    Carrier,
    Checkpoint,
    CheckpointStatus,
    Grant,
    OutstandingCall,
    PendingApproval,
)
from tesserix_adk.checkpoint.payload.frontier_codec import (
    CARRIER_FORMAT,
    MASKED_STATE_FORMAT,
    decode_checkpoint,
    encode_checkpoint,
    tombstone_payload,
)
from tesserix_adk.checkpoint.payload.observation import (
    NAMING_FORMAT,
    observation_refers,
    resolve_observation,
)
from tesserix_adk.checkpoint.payload.outcomes import (
    OutcomeState,
    RecordedOutcome,
    decode_outcome,
    encode_outcome,
    outcome_state,
    record_tag,
    recorded_outcome,
)
from tesserix_adk.checkpoint.payload.redacting import redact_outcome_content
from tesserix_adk.checkpoint.payload.transcript import (
    decode_message,
    decode_messages,
    encode_message,
)

__all__ = [
    "CARRIER_FORMAT",
    "MASKED_STATE_FORMAT",
    "CHECKPOINT_FORMAT",
    "DEFAULT_MAX_BYTES",
    "MAX_NESTING",
    "NAMING_FORMAT",
    "Boundary",
    "Carrier",
    "Checkpoint",
    "CheckpointStatus",
    "Grant",
    "OutstandingCall",
    "PendingApproval",
    "OutcomeState",
    "RecordedOutcome",
    "decode_checkpoint",
    "decode_message",
    "decode_messages",
    "decode_outcome",
    "outcome_state",
    "encode_checkpoint",
    "encode_message",
    "encode_outcome",
    "observation_refers",
    "record_tag",
    "recorded_outcome",
    "redact_outcome_content",
    "resolve_observation",
    "seal",
    "tombstone_payload",
    "unseal",
    "within_nesting",
]
