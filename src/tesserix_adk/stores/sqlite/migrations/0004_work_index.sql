-- Version 4: the runs that want a worker (the work index), one row per run ever submitted,
-- wanted or parked; times are SQLite's clock in epoch seconds. take_order is derived from
-- state: the order workers take runs in (decided 0, wanted 1, submitted 2), NULL for parked
-- and done rows, which the partial indexes adk_work_due and adk_work_due_by_agent therefore
-- leave out, so finding work reads the head of one of them and no other row. Done rows
-- stay: a submission is answered once per id, even after its run finished.
CREATE TABLE IF NOT EXISTS adk_work (
    tenant     TEXT NOT NULL,
    run_id     TEXT NOT NULL,
    agent      TEXT NOT NULL,
    state      TEXT NOT NULL
        CHECK (state IN ('decided', 'wanted', 'submitted', 'parked', 'done')),
    take_order INTEGER GENERATED ALWAYS AS (
        CASE state WHEN 'decided' THEN 0 WHEN 'wanted' THEN 1 WHEN 'submitted' THEN 2 END
    ) VIRTUAL,
    since      REAL NOT NULL,
    not_before REAL,
    attempts   INTEGER NOT NULL DEFAULT 0,
    reason     TEXT,
    input      BLOB,
    PRIMARY KEY (tenant, run_id)
);
CREATE INDEX IF NOT EXISTS adk_work_due ON adk_work (take_order, since, tenant, run_id)
    WHERE take_order IS NOT NULL;
-- The same head per agent, for workers that carry only some agents.
CREATE INDEX IF NOT EXISTS adk_work_due_by_agent
    ON adk_work (agent, take_order, since, tenant, run_id)
    WHERE take_order IS NOT NULL;
-- Operators list what is not done (parked runs above all) oldest first.
CREATE INDEX IF NOT EXISTS adk_work_listed ON adk_work (since, tenant, run_id)
    WHERE state <> 'done';
