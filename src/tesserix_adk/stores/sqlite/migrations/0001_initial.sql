CREATE TABLE IF NOT EXISTS adk_schema_version (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    version INTEGER NOT NULL
);

-- The highest fence each kind of store has seen per run. Rows are never deleted: forgetting
-- a run must not let a superseded holder write again.
CREATE TABLE IF NOT EXISTS adk_fences (
    store  TEXT NOT NULL,
    tenant TEXT NOT NULL,
    run_id TEXT NOT NULL,
    fence  INTEGER NOT NULL,
    PRIMARY KEY (store, tenant, run_id)
) WITHOUT ROWID;

-- One frontier per run: the last accepted put, what resume reads.
CREATE TABLE IF NOT EXISTS adk_frontiers (
    tenant  TEXT NOT NULL,
    run_id  TEXT NOT NULL,
    step    INTEGER NOT NULL,
    fence   INTEGER,
    payload BLOB NOT NULL,
    PRIMARY KEY (tenant, run_id)
);

-- Step snapshots, for replay and inspection; pruned to keep_last per run.
CREATE TABLE IF NOT EXISTS adk_checkpoint_steps (
    tenant  TEXT NOT NULL,
    run_id  TEXT NOT NULL,
    step    INTEGER NOT NULL,
    fence   INTEGER,
    payload BLOB NOT NULL,
    PRIMARY KEY (tenant, run_id, step)
);

-- Idempotency records; times are SQLite's clock in epoch seconds.
CREATE TABLE IF NOT EXISTS adk_idempotency (
    key          TEXT PRIMARY KEY,
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
CREATE INDEX IF NOT EXISTS adk_idempotency_run ON adk_idempotency (tenant, run_id);

-- One row per run ever leased: fence counts acquisitions and never goes back; holder is
-- NULL once released.
CREATE TABLE IF NOT EXISTS adk_run_leases (
    tenant     TEXT NOT NULL,
    run_id     TEXT NOT NULL,
    fence      INTEGER NOT NULL,
    holder     TEXT,
    expires_at REAL,
    PRIMARY KEY (tenant, run_id)
);

-- Transcripts out of line: row `position` holds message position-1 and the chained digest
-- of the prefix of `position` messages.
CREATE TABLE IF NOT EXISTS adk_history (
    tenant   TEXT NOT NULL,
    run_id   TEXT NOT NULL,
    position INTEGER NOT NULL,
    digest   TEXT NOT NULL,
    item     BLOB NOT NULL,
    PRIMARY KEY (tenant, run_id, position)
);

CREATE TABLE IF NOT EXISTS adk_ledger (
    tenant        TEXT NOT NULL,
    run_id        TEXT NOT NULL,
    micros        INTEGER NOT NULL,
    input_tokens  INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    PRIMARY KEY (tenant, run_id)
);

CREATE TABLE IF NOT EXISTS adk_approvals (
    id           TEXT PRIMARY KEY,
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
