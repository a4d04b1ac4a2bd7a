-- The runs that want a worker (the work index), one row per run ever submitted, wanted or
-- parked. take_order is derived from state: the order workers take runs in (decided,
-- wanted, submitted), NULL for parked and done rows, which adk_work_due therefore leaves
-- out, so finding work reads the head of that index (or of adk_work_due_by_agent) and no
-- other row. Done rows stay:
-- a submission is answered once per id, even after its run finished.
CREATE TABLE IF NOT EXISTS adk_work (
    tenant     text NOT NULL,
    run_id     text NOT NULL,
    agent      text NOT NULL,
    state      text NOT NULL
        CHECK (state IN ('decided', 'wanted', 'submitted', 'parked', 'done')),
    take_order smallint GENERATED ALWAYS AS (
        CASE state WHEN 'decided' THEN 0 WHEN 'wanted' THEN 1 WHEN 'submitted' THEN 2 END
    ) STORED,
    since      timestamptz NOT NULL,
    not_before timestamptz,
    attempts   integer NOT NULL DEFAULT 0,
    reason     text,
    input      bytea,
    PRIMARY KEY (tenant, run_id)
);
CREATE INDEX IF NOT EXISTS adk_work_due ON adk_work (take_order, since, tenant, run_id)
    WHERE take_order IS NOT NULL;
-- The same head per agent, for workers that carry only some agents.
CREATE INDEX IF NOT EXISTS adk_work_due_by_agent
    ON adk_work (agent, take_order, since, tenant, run_id)
    WHERE take_order IS NOT NULL;
-- Operators list what is not done (and parked runs above all) oldest first.
CREATE INDEX IF NOT EXISTS adk_work_listed ON adk_work (since, tenant, run_id)
    WHERE state <> 'done';
