"""tesserix-adk: an agent development kit that carries a run on after its process died.

Checkpoints at safe boundaries, resume that never makes a side-effecting call twice and
never guesses, leases with fences so one worker carries a run, redaction before anything
is stored, replay for debugging, and an operator CLI (``tesserix``).

Importing this package imports no database driver and does no I/O.
"""

from tesserix_adk.agent import Agent
from tesserix_adk.checkpoint.checkpointer import DEFAULT_MAX_BYTES, Checkpointer, CheckpointPolicy
from tesserix_adk.checkpoint.continuation import (
    DEFAULT_CONTINUATION,
    Continuation,
    ContinuationPolicy,
    continued,
)
from tesserix_adk.checkpoint.payload import (
    CHECKPOINT_FORMAT,
    Boundary,
    Checkpoint,
    CheckpointStatus,
    Grant,
    OutstandingCall,
    PendingApproval,
)
from tesserix_adk.checkpoint.planning import (
    PlannedCall,
    ResumePlan,
    ToolDisposition,
    plan_resume,
    refuse_if_undecidable,
)
from tesserix_adk.checkpoint.redaction import Redactor
from tesserix_adk.errors import (
    AdkError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointTooLargeError,
    ConfigurationError,
    DivergedRunError,
    HistoryUnavailableError,
    IndeterminateToolCallError,
    LeaseError,
    LeaseHeldError,
    LeaseLostError,
    NoCheckpointError,
    ProviderError,
    ResumeConflictError,
    ResumeError,
    RevisionMismatchError,
    RunFailedError,
    StaleFenceError,
    StoreReplyLostError,
    StoreUnavailableError,
)
from tesserix_adk.leases import Leaseholder, LeasePolicy
from tesserix_adk.messages import (
    BinaryPart,
    Message,
    Role,
    TextPart,
    ToolCall,
    ToolOutcome,
    Usage,
)
from tesserix_adk.providers.base import ModelRequest, ModelResponse, Provider
from tesserix_adk.providers.scripted import ScriptedProvider, ScriptedTurn
from tesserix_adk.resumer import CarriedRun, Resumer
from tesserix_adk.runner import AgentRunner, Run, RunStatus
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.stores.memory import (
    MemoryApprovalStore,
    MemoryCheckpointStore,
    MemoryHistoryStore,
    MemoryIdempotencyStore,
    MemoryLeaseStore,
    MemoryLedger,
)
from tesserix_adk.stores.protocols import (
    ApprovalRequest,
    ApprovalStatus,
    ApprovalStore,
    CheckpointStore,
    HistoryHandle,
    HistoryStore,
    IdempotencyRecord,
    IdempotencyStore,
    LeaseStore,
    Ledger,
    RecordStatus,
    RunLease,
    StoredCheckpoint,
    ToolFlags,
)
from tesserix_adk.stores.urls import open_stores
from tesserix_adk.tools import Tool, ToolContext, ToolSpec, default_key, tool

__all__ = [
    "CHECKPOINT_FORMAT",
    "DEFAULT_CONTINUATION",
    "DEFAULT_MAX_BYTES",
    "AdkError",
    "Agent",
    "AgentRunner",
    "ApprovalRequest",
    "ApprovalStatus",
    "ApprovalStore",
    "BinaryPart",
    "Boundary",
    "CarriedRun",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointPolicy",
    "CheckpointStatus",
    "CheckpointStore",
    "CheckpointTooLargeError",
    "Checkpointer",
    "ConfigurationError",
    "Continuation",
    "ContinuationPolicy",
    "DivergedRunError",
    "Grant",
    "HistoryHandle",
    "HistoryStore",
    "HistoryUnavailableError",
    "IdempotencyRecord",
    "IdempotencyStore",
    "IndeterminateToolCallError",
    "LeaseError",
    "LeaseHeldError",
    "LeaseLostError",
    "LeasePolicy",
    "LeaseStore",
    "Leaseholder",
    "Ledger",
    "MemoryApprovalStore",
    "MemoryCheckpointStore",
    "MemoryHistoryStore",
    "MemoryIdempotencyStore",
    "MemoryLeaseStore",
    "MemoryLedger",
    "Message",
    "ModelRequest",
    "ModelResponse",
    "NoCheckpointError",
    "OutstandingCall",
    "PendingApproval",
    "PlannedCall",
    "Provider",
    "ProviderError",
    "RecordStatus",
    "Redactor",
    "ResumeConflictError",
    "ResumeError",
    "ResumePlan",
    "Resumer",
    "RevisionMismatchError",
    "Role",
    "Run",
    "RunFailedError",
    "RunLease",
    "RunStatus",
    "ScriptedProvider",
    "ScriptedTurn",
    "StaleFenceError",
    "StoreReplyLostError",
    "StoreUnavailableError",
    "StoredCheckpoint",
    "Stores",
    "TextPart",
    "Tool",
    "ToolCall",
    "ToolContext",
    "ToolDisposition",
    "ToolFlags",
    "ToolOutcome",
    "ToolSpec",
    "Usage",
    "continued",
    "default_key",
    "open_stores",
    "plan_resume",
    "refuse_if_undecidable",
    "tool",
]
