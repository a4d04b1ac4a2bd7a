"""The public API is pinned: adding or removing a name is a deliberate change."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tesserix_adk

EXPECTED = {
    "CallDisposition",
    "FrontierWritten",
    "RunEvent",
    "RunFinished",
    "StreamingProvider",
    "TextDelta",
    "TextSink",
    "ToolCallAsked",
    "ToolCallFinished",
    "ToolCallStarted",
    "Backoff",
    "Carried",
    "MemoryWorkIndex",
    "Reconciled",
    "ReconciledAs",
    "RunStoppedError",
    "ReplayNotResumableError",
    "CarriedByWorkflowError",
    "Worker",
    "WorkIndex",
    "WorkItem",
    "WorkState",
    "NEVER_RAN_MARGIN",
    "AdkError",
    "Agent",
    "AgentRunner",
    "ApprovalRequest",
    "ApprovalStatus",
    "ApprovalStore",
    "BinaryPart",
    "Boundary",
    "CHECKPOINT_FORMAT",
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
    "DEFAULT_CONTINUATION",
    "continued",
    "DEFAULT_MAX_BYTES",
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
    "ProviderError",
    "Provider",
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
    "RunStartedError",
    "RunLease",
    "RunStatus",
    "ScriptedProvider",
    "ScriptedTurn",
    "SchemaMismatchError",
    "StaleFenceError",
    "StateRedactedError",
    "StorePermissionError",
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
    "ToolOutcomeUnknownError",
    "ToolSpec",
    "Usage",
    "default_key",
    "open_stores",
    "plan_resume",
    "refuse_if_undecidable",
    "tool",
}


def test_public_api_is_exactly_the_pinned_names() -> None:
    assert set(tesserix_adk.__all__) == EXPECTED
    for name in EXPECTED:
        assert getattr(tesserix_adk, name) is not None


def test_the_store_entry_points_are_the_same_at_the_top_and_in_stores() -> None:
    import tesserix_adk.stores

    assert tesserix_adk.open_stores is tesserix_adk.stores.open_stores
    assert tesserix_adk.Stores is tesserix_adk.stores.Stores
    assert set(tesserix_adk.stores.__all__) == {"Stores", "open_stores", "redact_url"}
    assert isinstance(tesserix_adk.open_stores("memory://"), tesserix_adk.Stores)


def test_errors_carry_retryable_as_data() -> None:
    assert tesserix_adk.StoreUnavailableError("x").retryable is True
    assert tesserix_adk.IndeterminateToolCallError("x").retryable is False
    assert tesserix_adk.DivergedRunError("x").retryable is False
    assert tesserix_adk.CheckpointTooLargeError("x", retryable=False).retryable is False
    assert issubclass(tesserix_adk.StaleFenceError, tesserix_adk.CheckpointError)
    assert issubclass(tesserix_adk.ResumeConflictError, tesserix_adk.ResumeError)
    assert issubclass(tesserix_adk.LeaseHeldError, tesserix_adk.LeaseError)


def test_the_mcp_package_pins_its_names() -> None:
    pytest.importorskip("mcp", reason="the [mcp] extra is not installed")
    import tesserix_adk.mcp

    assert set(tesserix_adk.mcp.__all__) == {
        "DEFAULT_MAX_REPLY_ITEMS",
        "IDEMPOTENCY_KEY_META",
        "MCPError",
        "MCPReplyLostError",
        "MCPTool",
        "MCPToolOverride",
        "MCPToolError",
        "MCPToolset",
        "MCPUnavailableError",
    }
    # A lost reply leaves the call in doubt, as any tool's unknown outcome does.
    assert issubclass(tesserix_adk.mcp.MCPReplyLostError, tesserix_adk.ToolOutcomeUnknownError)


def test_importing_the_kit_imports_no_driver() -> None:
    code = (
        "import sys, tesserix_adk, tesserix_adk.stores\n"
        "bad = [m for m in ('redis', 'psycopg', 'psycopg_pool', 'openai', 'anthropic',"
        " 'temporalio', 'sqlite3') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
