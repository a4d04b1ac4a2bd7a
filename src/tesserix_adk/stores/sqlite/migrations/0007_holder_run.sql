-- Version 7: a claim another run took over (a business key two runs share) names that run
-- (holder_run) with its turn and call id, while the record stays the first run's call: a
-- third run meeting it looks at the lease of the run whose holder may be sending it, and
-- the taker's listing finds it by its own index. A kit from before would write its records
-- without the columns and drop the names, so the version rises.
ALTER TABLE adk_idempotency ADD COLUMN holder_run TEXT;
ALTER TABLE adk_idempotency ADD COLUMN holder_iteration INTEGER;
ALTER TABLE adk_idempotency ADD COLUMN holder_call_id TEXT;
CREATE INDEX IF NOT EXISTS adk_idempotency_taken
    ON adk_idempotency (tenant, holder_run, holder_iteration) WHERE holder_run IS NOT NULL;
