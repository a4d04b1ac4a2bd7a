"""The whole error tree of tesserix-adk.

Retryability is data (``.retryable``), not a class: a caller decides whether to try again by
reading the attribute, never by matching on names.

::

    AdkError (.retryable)
    ├── ConfigurationError            a usage mistake; fix the code or the deployment
    │   ├── SchemaMismatchError       the store's schema is not this kit's version
    │   └── StorePermissionError      the store refuses the kit's user what it needs
    ├── StoreUnavailableError         a store could not be reached (retryable)
    │   └── StoreReplyLostError       sent, but the reply was lost: the outcome is unknown
    ├── ProviderError                 a model call failed (.retryable, .status_code)
    ├── ToolOutcomeUnknownError       a tool sent its call and lost the reply: left in doubt
    ├── CheckpointError
    │   ├── CheckpointFormatError     written by a newer kit; left untouched for it
    │   ├── CheckpointCorruptError    cannot be decoded or verified
    │   ├── CheckpointTooLargeError   over max_bytes; refused, never truncated
    │   └── StaleFenceError           another worker carries the run now
    ├── ResumeError
    │   ├── IndeterminateToolCallError  nobody can say whether a call ran (.calls)
    │   ├── DivergedRunError            the resumed model asks for something else
    │   ├── ResumeConflictError         another worker, or run, holds it (.holder)
    │   │   └── RunStartedError         a start found the run started: resume it
    │   ├── RevisionMismatchError       the agent changed since the frontier was written
    │   ├── HistoryUnavailableError     the transcript no longer resolves
    │   ├── NoCheckpointError           nothing checkpointed under that id
    │   ├── RunFailedError              the run ended ``failed``; it is not carried on
    │   ├── ReplayNotResumableError     a replay is carried on only by the replay itself
    │   ├── CarriedByWorkflowError      a workflow engine (Temporal) carries the run
    │   ├── StateRedactedError          the stored state lost a secret to redaction
    │   └── RunStoppedError             stopped at a boundary on request (retryable)
    └── LeaseError
        ├── LeaseHeldError            another holder has the lease (.holder)
        └── LeaseLostError            this holder's lease lapsed or was taken
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = [
    "AdkError",
    "CallInDoubt",
    "CarriedByWorkflowError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointTooLargeError",
    "ConfigurationError",
    "DivergedRunError",
    "HistoryUnavailableError",
    "IndeterminateToolCallError",
    "LeaseError",
    "LeaseHeldError",
    "LeaseLostError",
    "NoCheckpointError",
    "ProviderError",
    "ReplayNotResumableError",
    "ResumeConflictError",
    "ResumeError",
    "RevisionMismatchError",
    "RunFailedError",
    "RunStartedError",
    "RunStoppedError",
    "SchemaMismatchError",
    "StaleFenceError",
    "StateRedactedError",
    "StorePermissionError",
    "StoreReplyLostError",
    "StoreUnavailableError",
]


class AdkError(Exception):
    """Base of every error the kit raises on purpose."""

    retryable: bool = False

    def __init__(self, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(message)
        if retryable is not None:
            self.retryable = retryable


class ConfigurationError(AdkError):
    """The kit was wired or called in a way that cannot work."""


class SchemaMismatchError(ConfigurationError):
    """The store holds no schema of this kit's version (none, an earlier one that
    ``tesserix schema apply`` migrates, or a later one): a matter of the store, not of any
    one run, so a worker stops on it rather than park the run it was carrying."""


class StorePermissionError(ConfigurationError):
    """The store refuses the kit's database user (or Redis ACL user) what it needs: like a
    schema mismatch, a matter of the store, on which a worker stops rather than park runs."""


class StoreUnavailableError(AdkError):
    """A store could not be reached; trying again later is the right answer.

    Raised as itself only when the request certainly did not take effect (it never reached
    the store, or the store refused it whole). ``outcome_unknown`` is ``False``.
    """

    retryable = True
    outcome_unknown: bool = False


class StoreReplyLostError(StoreUnavailableError):
    """The request was sent and may have been applied, but its reply was lost (a dropped
    connection mid-reply, a client-side deadline). Whoever cares reads the record back."""

    outcome_unknown = True


class ToolOutcomeUnknownError(AdkError):
    """Raised by a tool that sent its request and cannot say whether it took effect (the
    reply was lost, a timeout struck after sending).

    Any other exception a tool raises is the call's error outcome, told to the model. This
    one is not: the model would likely ask again, under a new key, and the effect could
    happen twice. The call is left in doubt (its claim stays in flight) and the attempt
    stops, retryably; the resume asks the tool's reconciler or refuses the call as
    indeterminate, naming it, exactly as for a process that died inside the call.
    """

    retryable = True
    outcome_unknown = True


class ProviderError(AdkError):
    """A model call failed after the provider's own retries.

    ``retryable`` says whether carrying the run on later may succeed (rate limits, 5xx,
    timeouts); a non-retryable one (bad request, auth) ends the run ``failed``.
    """

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = False,
        status_code: int | None = None,
        paid: tuple[int, Any] | None = None,
    ) -> None:
        super().__init__(message, retryable=retryable)
        self.status_code = status_code
        # What a call the vendor billed cost (micros, a ``messages.Usage``: the error tree
        # imports nothing of the kit) though its answer could not be taken (a stream cut
        # after its usage, an unreadable reply): the run charges it, so a budget counts it
        # before the model is asked again.
        self.paid = paid


class CheckpointError(AdkError):
    """A frontier could not be written or read."""


class CheckpointFormatError(CheckpointError):
    """The payload was written in a format newer than this kit reads."""


class CheckpointCorruptError(CheckpointError):
    """The payload cannot be decoded or does not verify."""


class CheckpointTooLargeError(CheckpointError):
    """A payload over ``max_bytes``; it was refused, not truncated."""


class StaleFenceError(CheckpointError):
    """A write carried a fence lower than one the store has seen: another worker has the run."""


class ResumeError(AdkError):
    """A run cannot be carried on as asked."""


class CallInDoubt(Protocol):
    """What ``IndeterminateToolCallError.calls`` holds of each call: the kit raises it with
    ``checkpoint.planning.PlannedCall``; typed by shape, so the error tree depends on no
    other module of the kit."""

    @property
    def call_id(self) -> str | None:
        """The model's id of the call, if the frontier named it."""
        ...

    @property
    def tool(self) -> str:
        """The tool's name."""
        ...

    @property
    def key(self) -> str | None:
        """The idempotency key of the call, if it has a record."""
        ...

    @property
    def reason(self) -> str:
        """Why nobody can decide, in words an operator reads."""
        ...

    @property
    def iteration(self) -> int | None:
        """The loop iteration that asked for the call."""
        ...

    @property
    def arguments(self) -> Mapping[str, Any] | None:
        """The call's (redacted) arguments, where known."""
        ...

    def describe(self) -> str:
        """One line: ``<tool> (<call id>): <disposition> - <reason>``."""
        ...


class IndeterminateToolCallError(ResumeError):
    """Nobody can say whether these calls ran; an operator has to decide (never retryable)."""

    def __init__(self, message: str, *, calls: Sequence[CallInDoubt] = ()) -> None:
        super().__init__(message, retryable=False)
        self.calls: tuple[CallInDoubt, ...] = tuple(calls)


class DivergedRunError(ResumeError):
    """The resumed run asks for something other than what already happened."""


class ResumeConflictError(ResumeError):
    """Another worker holds the run, or another run is sending a call this run needs (a
    business key the two share); ``holder`` is that holder. Try again once it lets go."""

    retryable = True

    def __init__(self, message: str, *, holder: str | None = None) -> None:
        super().__init__(message)
        self.holder = holder


class RunStartedError(ResumeConflictError):
    """``run`` found the run already started (another worker got there first, or an
    earlier attempt did): nothing was done; resume it instead. Retryable, as a resume."""


class RevisionMismatchError(ResumeError):
    """The agent's revision differs from the one the frontier pinned."""


class HistoryUnavailableError(ResumeError):
    """The transcript a frontier points at no longer resolves to the same bytes."""


class NoCheckpointError(ResumeError):
    """Nothing is checkpointed under that run id (or step) for that tenant."""


class RunFailedError(ResumeError):
    """The run ended ``failed``; it is not carried on."""


class ReplayNotResumableError(ResumeError):
    """The run is a replay that stopped before it finished: only the ``replay`` call that
    started it had its stubs (they are not stored), so nothing carries it on; replay again
    instead (never retryable)."""


class CarriedByWorkflowError(ResumeError):
    """The run is carried by a workflow engine (its Temporal workflow), which alone carries
    it on: the kit's own resume and workers leave it alone (never retryable). A run whose
    workflow closed is carried on by starting a new one (``tesserix submit --temporal``)."""


class StateRedactedError(ResumeError):
    """The run's state, as its frontier (or submission) keeps it, had a secret masked: a
    resumed run's tools would be handed the mask as if it were the value, so it is not
    carried on (never retryable). Keep credentials out of the state."""


class RunStoppedError(ResumeError):
    """The run stopped at a boundary because its worker was asked to (draining); nothing
    is half-done, and any worker carries it on from its frontier."""

    retryable = True


class LeaseError(AdkError):
    """A lease could not be taken or kept."""


class LeaseHeldError(LeaseError):
    """Another holder has the run's lease (``holder`` is informational)."""

    retryable = True

    def __init__(self, message: str, *, holder: str | None = None) -> None:
        super().__init__(message)
        self.holder = holder


class LeaseLostError(LeaseError):
    """This holder's lease lapsed or was taken; stop before the next durable write."""
