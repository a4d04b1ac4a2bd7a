"""Our side of the benchmark: the conversation through the real ``AgentRunner``.

A provider that answers the next turn at once, and a side-effecting, keyed tool (the
default key) that answers the ~500-character result, so every turn is the whole durable
path: the model call charged and checkpointed (``after_model_call``), the call claimed in
the idempotency store before it is sent, its outcome recorded, the transcript appended
and ``after_tool_result`` checkpointed, under a lease and its fence.

A turn's cost is the time between two consecutive model calls. A process death is stood
for by a ``BaseException`` raised from the provider (as the kit's tests do): the runner
writes nothing more and the last frontier stays resumable.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import conversation as conv

from tesserix_adk import Agent, AgentRunner, Message, ToolCall, open_stores, tool
from tesserix_adk.providers.base import ModelRequest, ModelResponse

TENANT = "bench"
RESUME_CLAIM_TTL = 0.2  # seconds

Window = Callable[[], AbstractContextManager[Any]]


class Died(BaseException):
    """Stands for the death of the process holding the run."""


@tool
async def lookup(query: str, page: int) -> str:
    """Look a page up (side-effecting and keyed: claimed before it is sent)."""
    return conv.turn(page).result


def agent(turns: int) -> Agent:
    return Agent("bench", "Answer from the lookups.", [lookup], max_iterations=turns + 2)


@dataclass
class TurnsProvider:
    """Answers turn after turn at once; stamps each call's time.

    ``turns``: how many tool-calling turns before the final answer. ``die_at``: the model
    call (0-based, counted from this provider's first) that raises ``Died`` instead.
    ``window``: counted from call ``window_from`` to call ``window_from + window_turns``.
    """

    turns: int
    die_at: int | None = None
    window: Window | None = None
    window_from: int = 0
    window_turns: int = 0
    probe: Callable[[int], None] | None = None
    stamps: list[float] = field(default_factory=list)
    _open: Any = None
    counts: Any = None

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.stamps.append(time.perf_counter())
        calls = len(self.stamps) - 1
        if self.probe is not None:
            self.probe(calls)
        if self.window is not None:
            if calls == self.window_from:
                self._open = self.window()
                self.counts = self._open.__enter__()
            elif calls == self.window_from + self.window_turns and self._open is not None:
                self._open.__exit__(None, None, None)
                self._open = None
        if self.die_at is not None and calls >= self.die_at:
            raise Died
        # The transcript is the input, then (assistant, tool) per turn: O(1) to read.
        index = (len(request.messages) - 1) // 2
        if index >= self.turns:
            return ModelResponse(message=Message.assistant(conv.ANSWER))
        turn = conv.turn(index)
        call = ToolCall(id=turn.call_id, name=conv.TOOL, arguments=dict(turn.arguments))
        return ModelResponse(message=Message.assistant("", [call]))


@dataclass
class Measured:
    turn_seconds: list[float]  # one per turn
    counts: Any = None
    bytes_added: int | None = None


async def run_turns(
    url: str,
    turns: int,
    *,
    window: Window | None = None,
    window_turns: int = 0,
    size: Callable[[], int] | None = None,
    probe: Callable[[int], None] | None = None,
) -> Measured:
    """One run of ``turns`` turns to its final answer on a fresh run id."""
    async with open_stores(url) as stores:
        await stores.create_schema()
        before = size() if size is not None else None
        provider = TurnsProvider(
            turns=turns,
            window=window,
            window_from=max(1, turns - window_turns - 1) if window else 0,
            window_turns=window_turns,
            probe=probe,
        )
        runner = AgentRunner.from_stores(provider, stores, worker="bench", group_writes=True)
        run_id = f"turns-{secrets.token_hex(6)}"
        await runner.run(agent(turns), conv.QUESTION, tenant=TENANT, run_id=run_id)
        stamps = provider.stamps
    added = None if size is None or before is None else size() - before
    return Measured(
        turn_seconds=[b - a for a, b in itertools.pairwise(stamps)][:turns],
        counts=provider.counts,
        bytes_added=added,
    )


async def resume_costs(
    url: str, turns: int, times: int, window: Window | None = None
) -> tuple[list[float], Any, float]:
    """A run stopped (its process dead) after ``turns`` turns, then resumed ``times`` times up
    to its next model call: the seconds of each resume, the counts of one more resume
    (``window``), and the seconds the ``turns`` turns took to build."""
    async with open_stores(url) as stores:
        await stores.create_schema()
        runner_agent = agent(turns + times + 4)
        run_id = f"resume-{secrets.token_hex(6)}"
        started = time.perf_counter()
        build = TurnsProvider(turns=turns + times + 4, die_at=turns)
        with contextlib.suppress(Died):
            await AgentRunner.from_stores(build, stores, worker="bench", group_writes=True).run(
                runner_agent, conv.QUESTION, tenant=TENANT, run_id=run_id
            )
        built = time.perf_counter() - started
        seconds: list[float] = []
        counts = None
        for n in range(times + (1 if window else 0)):
            provider = TurnsProvider(turns=turns + times + 4, die_at=0)
            # The dead resume's claim keeps others out for its ttl: a short one, waited out.
            runner = AgentRunner.from_stores(
                provider,
                stores,
                worker="bench",
                resume_claim_ttl=RESUME_CLAIM_TTL,
                group_writes=True,
            )
            if n:
                await asyncio.sleep(RESUME_CLAIM_TTL * 1.5)
            counting = window() if window is not None and n == times else None
            if counting is not None:
                counts = counting.__enter__()
            started = time.perf_counter()
            with contextlib.suppress(Died):
                await runner.resume(runner_agent, run_id, tenant=TENANT)
            if counting is not None:
                counting.__exit__(None, None, None)
            if not provider.stamps:
                raise RuntimeError("the resume never reached the model")
            if counting is None:
                seconds.append(provider.stamps[0] - started)
    return seconds, counts, built


async def throughput(url: str, runs: int, turns: int, *, grouped: bool = False) -> float:
    """Durable turns per second of ``runs`` concurrent runs of ``turns`` turns in this
    process, one runner over one set of stores (as one worker carries them); by default
    without write groups, as ``AgentRunner`` runs unless asked."""
    async with open_stores(url) as stores:
        await stores.create_schema()
        tag = secrets.token_hex(4)
        runner = AgentRunner.from_stores(
            TurnsProvider(turns=turns), stores, worker="bench", group_writes=grouped
        )
        the_agent = agent(turns)
        started = time.perf_counter()
        await asyncio.gather(
            *(
                runner.run(the_agent, conv.QUESTION, tenant=TENANT, run_id=f"k{tag}-{n}")
                for n in range(runs)
            )
        )
        return runs * turns / (time.perf_counter() - started)


class _Baton:
    """Two runs in one process taking turns strictly: while the long run hands over, the
    fresh run does exactly one turn and hands back. Neither works while the other does."""

    def __init__(self) -> None:
        self.long_go = asyncio.Event()
        self.fresh_go = asyncio.Event()
        self.done = False
        self.long_turn = 0  # the long run's turn, for the fresh run's turns to be placed by


@dataclass
class _Alternating:
    """A provider whose turns' costs are measured from its return to its next call, so
    time spent waiting for the other run is left out."""

    turns: int
    baton: _Baton
    fresh: bool
    hand_over: Callable[[int], bool] = lambda call: False
    entered: list[float] = field(default_factory=list)
    returned: list[float] = field(default_factory=list)
    at: list[int] = field(default_factory=list)

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.entered.append(time.perf_counter())
        baton = self.baton
        index = (len(request.messages) - 1) // 2
        if not self.fresh:
            baton.long_turn = index
        self.at.append(baton.long_turn)
        if self.fresh:
            baton.long_go.set()  # the turn the long run waited for is done
            await baton.fresh_go.wait()
            baton.fresh_go.clear()
            if baton.done:
                raise Died
        elif self.hand_over(index):
            baton.long_go.clear()
            baton.fresh_go.set()
            await baton.long_go.wait()
        self.returned.append(time.perf_counter())
        if index >= self.turns:
            return ModelResponse(message=Message.assistant(conv.ANSWER))
        turn = conv.turn(index)
        call = ToolCall(id=turn.call_id, name=conv.TOOL, arguments=dict(turn.arguments))
        return ModelResponse(message=Message.assistant("", [call]))

    def costs(self) -> list[tuple[int, int, float]]:
        """(turn index, the long run's turn then, seconds) of each tool-calling turn."""
        return [
            (i, self.at[i], self.entered[i + 1] - self.returned[i])
            for i in range(len(self.entered) - 1)
        ]


async def flatness(
    url: str, turns: int, pieces: int, short: int, window: int = 20
) -> tuple[list[float], list[tuple[int, float, float]]]:
    """One long run of ``turns`` turns; in the last ``window`` turns of each of its
    ``pieces``, every turn alternates with a turn of fresh runs of ``short`` turns in the
    same process and stores, so late turns are timed right beside early ones.

    Returns the long run's seconds per turn and, per piece, (turns so far, median seconds
    of the long run's turns in the window, median of the fresh runs' turns in it)."""
    size = turns // pieces
    window = size if size <= 10 else min(window, size // 2)

    def in_window(index: int) -> bool:
        return index % size >= size - window

    baton = _Baton()
    long_provider = _Alternating(turns, baton, fresh=False, hand_over=in_window)
    fresh_costs: list[tuple[int, float]] = []  # (long run's turn then, seconds)
    async with open_stores(url) as stores:
        await stores.create_schema()
        tag = secrets.token_hex(6)

        async def fresh_runs() -> None:
            n = 0
            while not baton.done:
                provider = _Alternating(short, baton, fresh=True)
                runner = AgentRunner.from_stores(
                    provider, stores, worker="bench", group_writes=True
                )
                with contextlib.suppress(Died):
                    await runner.run(agent(short), conv.QUESTION, tenant=TENANT,
                                     run_id=f"fresh-{tag}-{n}")  # fmt: skip
                fresh_costs.extend((at, c) for i, at, c in provider.costs() if i >= 2)
                n += 1

        async def long_run() -> None:
            try:
                runner = AgentRunner.from_stores(
                    long_provider, stores, worker="bench", group_writes=True
                )
                await runner.run(agent(turns), conv.QUESTION, tenant=TENANT, run_id=f"long-{tag}")
            finally:
                baton.done = True
                baton.fresh_go.set()

        await asyncio.gather(long_run(), fresh_runs())
    costs = long_provider.costs()
    pairs = []
    for piece in range(1, pieces + 1):
        end = piece * size
        mine = [c for i, _, c in costs if end - window <= i < end]
        beside = [c for at, c in fresh_costs if end - window <= at < end]
        if mine and beside:
            pairs.append((end, statistics.median(mine), statistics.median(beside)))
    return [c for _, _, c in costs], pairs
