"""A store for the console's tests: a run waiting on approval (a secret planted in its tool
arguments), a parked run, and a run of another tenant; and the console served by uvicorn on
a free loopback port in a thread of the test process."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from tesserix_adk import (
    Agent,
    AgentRunner,
    LeasePolicy,
    RunStatus,
    ScriptedProvider,
    Worker,
    WorkState,
    open_stores,
    tool,
)
from tesserix_adk.stores.bundle import Stores
from tesserix_adk.testing.faults import SimulatedCrash

TENANT = "acme"
OTHER = "globex"
# A run id with markup, a quote and a slash in it: escaped in every page, still reachable.
ODD_RUN = '<i>odd</i>"/run'
SECRET = "sk-live-PLANTEDc0ns0leSecret0123456789"
# A call whose arguments redaction changed is never sent from a frontier (nobody could say
# what the masked value was), so the run an operator approves carries no secret...
WAIT_TURNS: list[Any] = [[("book_seat", {"flight": "LH123"})], "Booked LH123."]
# ...and the secrets are planted in the other tenant's waiting call and the parked call.
OTHER_TURNS: list[Any] = [
    [("book_seat", {"flight": "LH123", "api_key": SECRET})],
    "Booked LH123.",
]
PARK_TURNS: list[Any] = [[("charge_card", {"amount": 12, "password": SECRET})], "Charged."]


class World:
    """What the tools did: each booking and charge, by idempotency key."""

    def __init__(self) -> None:
        self.bookings: list[str] = []
        self.charges: list[str] = []
        self.crash_charge = False

    def approver(self) -> Agent:
        @tool(requires_approval=True)
        def book_seat(flight: str, ctx: Any, api_key: str | None = None) -> dict[str, str]:
            """Book a seat (needs a person's approval)."""
            self.bookings.append(f"{flight}:{ctx.idempotency_key}")
            return {"booking": f"B{len(self.bookings)}"}

        return Agent("approver", "Book.", [book_seat])

    def charger(self) -> Agent:
        @tool
        def charge_card(amount: int, password: str, ctx: Any) -> dict[str, str]:
            """Charge a card (no reconciler: a charge in doubt parks the run)."""
            if self.crash_charge:
                self.crash_charge = False
                raise SimulatedCrash("died while charging")
            self.charges.append(f"{amount}:{ctx.idempotency_key}")
            return {"charged": str(amount)}

        return Agent("charger", "Charge.", [charge_card])


def runner(stores: Stores, turns: list[Any]) -> AgentRunner:
    return AgentRunner.from_stores(
        ScriptedProvider(list(turns)),
        stores,
        lease_policy=LeasePolicy(ttl=2.0, renew_within=1.0),
        never_ran_margin=0.05,
    )


async def seed(url: str, world: World) -> None:
    """r-wait waits on approval, r-park is parked (a secret in its call), r-other of the
    other tenant waits on approval (a secret in its call)."""
    async with open_stores(url) as stores:
        await stores.create_schema()
        waiting = await runner(stores, WAIT_TURNS).run(
            world.approver(), "book", tenant=TENANT, run_id="r-wait"
        )
        assert waiting.status is RunStatus.waiting_approval
        world.crash_charge = True
        with contextlib.suppress(SimulatedCrash):
            await runner(stores, PARK_TURNS).run(
                world.charger(), "charge", tenant=TENANT, run_id="r-park"
            )
        await asyncio.sleep(2.1)  # the dead holder's lease lapses
        parker = Worker(
            runner(stores, PARK_TURNS),
            [world.charger()],
            exit_when_idle=True,
            poll_interval=0.01,
        )
        await asyncio.wait_for(parker.run(), 30)
        assert stores.work is not None
        assert [i.run_id for i in await stores.work.items(TENANT, state=WorkState.parked)] == [
            "r-park"
        ]
        other = await runner(stores, OTHER_TURNS).run(
            world.approver(), "book", tenant=OTHER, run_id="r-other"
        )
        assert other.status is RunStatus.waiting_approval
        odd = await runner(stores, WAIT_TURNS).run(
            world.approver(), "book", tenant=OTHER, run_id=ODD_RUN
        )
        assert odd.status is RunStatus.waiting_approval


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def served(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn on a free loopback port; yields its base URL."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", ws="none", http="h11"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the console did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
