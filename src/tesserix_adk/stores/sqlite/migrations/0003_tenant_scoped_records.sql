-- Version 3: idempotency records are keyed by (tenant, key). Two tenants may choose the same
-- key (a business key such as order-5); keyed by key alone, one tenant's claim would find,
-- complete or take over the other's record. SQLite cannot change a primary key, so the
-- table is rebuilt, rows and all.
CREATE TABLE adk_idempotency_v3 (
    key          TEXT NOT NULL,
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
    resolved_by  TEXT,
    PRIMARY KEY (tenant, key)
);
INSERT INTO adk_idempotency_v3 (key, status, holder, tenant, run_id, iteration, tool, call_id,
    side_effects, idempotent, fence, outcome, since, completed_at, expires_at, resolved_by)
    SELECT key, status, holder, tenant, run_id, iteration, tool, call_id, side_effects,
        idempotent, fence, outcome, since, completed_at, expires_at,
        resolved_by FROM adk_idempotency;
DROP TABLE adk_idempotency;
ALTER TABLE adk_idempotency_v3 RENAME TO adk_idempotency;
CREATE INDEX IF NOT EXISTS adk_idempotency_run ON adk_idempotency (tenant, run_id);
