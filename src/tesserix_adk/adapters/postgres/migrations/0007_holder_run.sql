-- A claim another run took over (a business key two runs share) names that run
-- (holder_run), while the record stays the first run's call: a third run meeting it looks
-- at the lease of the run whose holder may be sending it.
ALTER TABLE adk_idempotency ADD COLUMN IF NOT EXISTS holder_run text;
