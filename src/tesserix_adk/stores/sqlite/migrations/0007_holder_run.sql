-- Version 7: a claim another run took over (a business key two runs share) names that run
-- (holder_run), while the record stays the first run's call: a third run meeting it looks
-- at the lease of the run whose holder may be sending it. A kit from before would write
-- its records without the column and drop the name, so the version rises.
ALTER TABLE adk_idempotency ADD COLUMN holder_run TEXT;
