"""Least privilege: a migration role that owns the schema and applies it, and an application
role with only the grants operation needs, exactly as docs/deploying.md shows them.

The roles are created for each test under names of its own and dropped afterwards (with the
schema); nothing else on the shared server changes.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from adapters import services
from adapters.pooler import pgbouncer
from booking import BOOK_TURNS, Airline, booking_agent
from tesserix_adk import AgentRunner, RunStatus, ScriptedProvider
from tesserix_adk.errors import ConfigurationError
from tesserix_adk.messages import Usage
from tesserix_adk.stores.urls import open_stores

pytestmark = pytest.mark.postgres

T = "acme"


@dataclass(frozen=True, slots=True, kw_only=True)
class Roles:
    schema: str
    migrate: str
    app: str

    def login(self, role: str, base: str = services.POSTGRES_URL) -> str:
        """``base`` logged in as ``role`` (for psycopg itself)."""
        parts = urlsplit(base)
        host = parts.netloc.rpartition("@")[2]
        return urlunsplit((parts.scheme, f"{role}@{host}", parts.path, parts.query, ""))

    def url(self, role: str, base: str = services.POSTGRES_URL) -> str:
        """The store URL as ``role``, with the kit's ``schema=`` option."""
        return services.with_query(self.login(role, base), schema=self.schema)


# The grants docs/deploying.md shows, word for word but for the names.
ADMINISTRATOR = """
CREATE ROLE {migrate} LOGIN;
CREATE ROLE {app} LOGIN;
CREATE SCHEMA {schema} AUTHORIZATION {migrate};
GRANT USAGE ON SCHEMA {schema} TO {app};
"""
MIGRATION_ROLE = """
ALTER DEFAULT PRIVILEGES IN SCHEMA {schema}
    GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO {app};
"""
AFTER_APPLYING = """
REVOKE INSERT, UPDATE, DELETE ON {schema}.adk_schema_version FROM {app};
"""


async def _as(url: str, sql: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(sql)


@pytest.fixture
async def roles() -> AsyncIterator[Roles]:
    """A schema owned by a migration role, and an application role; all dropped after."""
    suffix = secrets.token_hex(4)
    roles = Roles(
        schema=f"adktest_{suffix}", migrate=f"adktest_migrate_{suffix}", app=f"adktest_app_{suffix}"
    )
    names = {"schema": roles.schema, "migrate": roles.migrate, "app": roles.app}
    try:
        admin = await psycopg.AsyncConnection.connect(
            services.POSTGRES_URL, autocommit=True, connect_timeout=3
        )
    except psycopg.OperationalError as exc:
        services.unavailable(f"PostgreSQL at {services.POSTGRES_URL} cannot be reached: {exc}")
    try:
        await admin.execute(ADMINISTRATOR.format(**names))
        try:
            await _as(roles.login(roles.migrate), MIGRATION_ROLE.format(**names))
            async with open_stores(roles.url(roles.migrate)) as stores:
                await stores.create_schema()
            await _as(roles.login(roles.migrate), AFTER_APPLYING.format(**names))
            yield roles
        finally:
            await admin.execute(f"DROP SCHEMA IF EXISTS {roles.schema} CASCADE")
            for role in (roles.app, roles.migrate):
                await admin.execute(f"DROP OWNED BY {role}")
                await admin.execute(f"DROP ROLE {role}")
    finally:
        await admin.close()


async def test_the_application_role_may_create_nothing(roles: Roles) -> None:
    # The test's premise: the role really lacks CREATE and cannot touch the version.
    async with await psycopg.AsyncConnection.connect(roles.login(roles.app)) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            await conn.execute(f"CREATE TABLE {roles.schema}.intruder (x int)")
    async with await psycopg.AsyncConnection.connect(roles.login(roles.app)) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            await conn.execute(f"UPDATE {roles.schema}.adk_schema_version SET version = 0")


async def test_create_schema_on_a_current_schema_is_a_no_op_the_application_role_may_run(
    roles: Roles,
) -> None:
    async with open_stores(roles.url(roles.app)) as stores:
        await stores.create_schema()
        await stores.verify()


async def test_the_application_role_carries_a_run_and_every_store_with_only_its_grants(
    roles: Roles,
) -> None:
    airline = Airline()
    async with open_stores(roles.url(roles.app)) as stores:
        runner = AgentRunner.from_stores(ScriptedProvider(BOOK_TURNS), stores)
        run = await runner.run(booking_agent(airline), "book", tenant=T, run_id="r1")
        assert run.status is RunStatus.completed
        assert airline.bookings == ["LH123"]
        # What a run may not have touched: approvals, the work index, forgetting a run.
        lease = await stores.leases.acquire(T, "r2", "worker-a", 30)
        await stores.ledger.charge(T, "r2", 1, Usage(input_tokens=3), fence=lease.fence)
        request = await stores.approvals.request(T, "r2", [], iteration=1, fence=lease.fence)
        await stores.approvals.decide(T, request.id, approved=True, by="ops")
        assert await stores.work.submit(T, "r3", agent="a", input=b"go")
        assert [item.run_id for item in await stores.work.due(limit=5)] == ["r3"]
        await stores.work.done(T, "r3")
        await stores.leases.release(lease)
        await stores.checkpoints.forget(T, "r1")
        assert await stores.checkpoints.latest(T, "r1") is None


async def test_the_application_role_cannot_apply_a_schema_that_is_not_current(
    roles: Roles,
) -> None:
    admin = await psycopg.AsyncConnection.connect(services.POSTGRES_URL, autocommit=True)
    try:
        await admin.execute(f"DROP TABLE {roles.schema}.adk_ledger")
    finally:
        await admin.close()
    async with open_stores(roles.url(roles.app)) as stores:
        with pytest.raises(ConfigurationError, match="PostgreSQL refused"):
            await stores.create_schema()
    async with open_stores(roles.url(roles.migrate)) as stores:
        await stores.create_schema()
        await stores.verify()


async def test_the_application_role_works_through_pgbouncer(roles: Roles) -> None:
    with pgbouncer(users={roles.app: ""}) as bouncer:
        url = services.with_query(roles.url(roles.app, bouncer.url()), prepare_threshold="none")
        async with open_stores(url) as stores:
            await stores.create_schema()
            await stores.verify()
            airline = Airline()
            runner = AgentRunner.from_stores(ScriptedProvider(BOOK_TURNS), stores)
            run = await runner.run(booking_agent(airline), "book", tenant=T, run_id="r1")
            assert run.status is RunStatus.completed
            assert airline.bookings == ["LH123"]
