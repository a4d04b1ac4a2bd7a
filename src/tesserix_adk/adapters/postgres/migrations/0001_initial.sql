-- The highest fence each kind of store has seen per run; NULL while only unfenced writes
-- were made. Rows are never deleted: forgetting a run must not let an old holder back in.
CREATE TABLE IF NOT EXISTS adk_fences (
    store  text NOT NULL,
    tenant text NOT NULL,
    run_id text NOT NULL,
    fence  bigint,
    PRIMARY KEY (store, tenant, run_id)
);

-- One frontier per run: the last accepted put, what resume reads.
CREATE TABLE IF NOT EXISTS adk_checkpoints (
    tenant     text NOT NULL,
    run_id     text NOT NULL,
    step       bigint NOT NULL,
    fence      bigint,
    payload    bytea NOT NULL,
    written_at timestamptz NOT NULL,
    PRIMARY KEY (tenant, run_id)
);

-- Step snapshots, for replay and inspection; pruned to keep_last per run.
CREATE TABLE IF NOT EXISTS adk_checkpoint_steps (
    tenant  text NOT NULL,
    run_id  text NOT NULL,
    step    bigint NOT NULL,
    fence   bigint,
    payload bytea NOT NULL,
    PRIMARY KEY (tenant, run_id, step)
);

-- One row per run ever leased: fence counts acquisitions and never goes back; holder is
-- NULL once released, and expires_at then keeps when the lease ended.
CREATE TABLE IF NOT EXISTS adk_run_leases (
    tenant     text NOT NULL,
    run_id     text NOT NULL,
    fence      bigint NOT NULL,
    holder     text,
    expires_at timestamptz,
    PRIMARY KEY (tenant, run_id)
);

-- Idempotency records. In-flight tool-call claims have no expires_at: they never lapse.
CREATE TABLE IF NOT EXISTS adk_idempotency (
    key          text PRIMARY KEY,
    status       text NOT NULL CHECK (status IN ('in_flight', 'completed', 'never_ran')),
    holder       text NOT NULL,
    tenant       text NOT NULL,
    run_id       text NOT NULL,
    iteration    integer,
    tool         text,
    call_id      text,
    side_effects boolean,
    idempotent   boolean,
    fence        bigint,
    outcome      bytea,
    since        timestamptz NOT NULL,
    completed_at timestamptz,
    expires_at   timestamptz,
    resolved_by  text
);
CREATE INDEX IF NOT EXISTS adk_idempotency_run ON adk_idempotency (tenant, run_id);

-- Transcripts out of line: row `position` holds message `position` (from 0) and the
-- chained digest of the prefix that ends with it.
CREATE TABLE IF NOT EXISTS adk_history (
    tenant   text NOT NULL,
    run_id   text NOT NULL,
    position integer NOT NULL,
    digest   text NOT NULL,
    item     bytea NOT NULL,
    PRIMARY KEY (tenant, run_id, position)
);

CREATE TABLE IF NOT EXISTS adk_ledger (
    tenant        text NOT NULL,
    run_id        text NOT NULL,
    micros        bigint NOT NULL,
    input_tokens  bigint NOT NULL,
    output_tokens bigint NOT NULL,
    PRIMARY KEY (tenant, run_id)
);

CREATE TABLE IF NOT EXISTS adk_approvals (
    id           text PRIMARY KEY,
    tenant       text NOT NULL,
    run_id       text NOT NULL,
    calls        json NOT NULL,
    iteration    integer NOT NULL,
    status       text NOT NULL CHECK (status IN ('pending', 'approved', 'denied')),
    decided_by   text,
    note         text,
    requested_at timestamptz NOT NULL,
    decided_at   timestamptz
);
CREATE INDEX IF NOT EXISTS adk_approvals_run ON adk_approvals (tenant, run_id);
