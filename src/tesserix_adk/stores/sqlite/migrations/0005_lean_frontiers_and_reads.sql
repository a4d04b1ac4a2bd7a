-- Version 5: a frontier is stored once, and a resume reads only the records it plans.
--
-- A frontier's payload lives in its step snapshot in adk_checkpoint_steps; the adk_frontiers
-- row says which step is the frontier, with an empty payload. Only when keep_last pruned the
-- frontier's own step (a run rewound below the steps it kept) does the row keep the payload
-- itself. Rows written before version 5 keep theirs and are read as they are; a kit from
-- before would read the empty payload as a damaged frontier, so the version rises and it
-- says to upgrade instead.
--
-- Planning a resume reads a run's records from the frontier's iteration on: indexed by
-- iteration within the run, it reads those rows alone, however long the run is. The index
-- serves every per-run read the one it replaces served.
CREATE INDEX IF NOT EXISTS adk_idempotency_run_iteration
    ON adk_idempotency (tenant, run_id, iteration);
DROP INDEX IF EXISTS adk_idempotency_run;
