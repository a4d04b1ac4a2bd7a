-- A claim another run took over (a business key two runs share) names that run
-- (holder_run) with its turn and call id, while the record stays the first run's call: a
-- third run meeting it looks at the lease of the run whose holder may be sending it, and
-- the taker's listing finds it by its own index.
ALTER TABLE adk_idempotency ADD COLUMN IF NOT EXISTS holder_run text;
ALTER TABLE adk_idempotency ADD COLUMN IF NOT EXISTS holder_iteration integer;
ALTER TABLE adk_idempotency ADD COLUMN IF NOT EXISTS holder_call_id text;
CREATE INDEX IF NOT EXISTS adk_idempotency_taken
    ON adk_idempotency (tenant, holder_run, holder_iteration) WHERE holder_run IS NOT NULL;
