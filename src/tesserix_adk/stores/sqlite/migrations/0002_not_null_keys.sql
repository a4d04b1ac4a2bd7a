-- Version 2: the idempotency key and the approval id are NOT NULL. SQLite lets a PRIMARY
-- KEY that is not an INTEGER hold NULL, and a record with a NULL key can never be found
-- by its key: its call would look as if it never ran. SQLite cannot add NOT NULL to a
-- column, so both tables are rebuilt, rows and all.
CREATE TABLE adk_idempotency_v2 (
    key          TEXT NOT NULL PRIMARY KEY,
    status       TEXT NOT NULL,
    holder       TEXT NOT NULL,
    tenant       TEXT NOT NULL,
    run_id       TEXT NOT NULL,
    iteration    INTEGER,
    tool         TEXT,
    call_id      TEXT,
    side_effects INTEGER,
    idempotent   INTEGER,
    fence        INTEGER,
    outcome      BLOB,
    since        REAL NOT NULL,
    completed_at REAL,
    expires_at   REAL,
    resolved_by  TEXT
);
INSERT INTO adk_idempotency_v2 (key, status, holder, tenant, run_id, iteration, tool, call_id,
    side_effects, idempotent, fence, outcome, since, completed_at, expires_at, resolved_by)
    SELECT key, status, holder, tenant, run_id, iteration, tool, call_id, side_effects,
        idempotent, fence, outcome, since, completed_at, expires_at,
        resolved_by FROM adk_idempotency;
DROP TABLE adk_idempotency;
ALTER TABLE adk_idempotency_v2 RENAME TO adk_idempotency;
CREATE INDEX IF NOT EXISTS adk_idempotency_run ON adk_idempotency (tenant, run_id);

CREATE TABLE adk_approvals_v2 (
    id           TEXT NOT NULL PRIMARY KEY,
    tenant       TEXT NOT NULL,
    run_id       TEXT NOT NULL,
    calls        TEXT NOT NULL,
    iteration    INTEGER NOT NULL,
    status       TEXT NOT NULL,
    decided_by   TEXT,
    note         TEXT,
    requested_at REAL NOT NULL,
    decided_at   REAL
);
INSERT INTO adk_approvals_v2 (id, tenant, run_id, calls, iteration, status, decided_by, note,
    requested_at, decided_at)
    SELECT id, tenant, run_id, calls, iteration, status, decided_by, note, requested_at,
        decided_at FROM adk_approvals;
DROP TABLE adk_approvals;
ALTER TABLE adk_approvals_v2 RENAME TO adk_approvals;
