-- Planning a resume reads a run's records from the frontier's iteration on (RecordsFrom):
-- this index finds those rows alone, however long the run already is. The index on
-- (tenant, run_id) it covers is left in place (dropping it by name would not honour the
-- URL's schema=); it costs a little on each write, nothing on reads.
CREATE INDEX IF NOT EXISTS adk_idempotency_run_iteration
    ON adk_idempotency (tenant, run_id, iteration);
