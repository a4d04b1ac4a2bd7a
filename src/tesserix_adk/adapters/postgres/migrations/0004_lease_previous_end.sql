-- The end of the lease before the current one, kept by each acquisition from the row it
-- locked (the latest version, whoever changed it last): what RunLease.previous_end
-- reports, and what a never-ran resolution waits a margin past. A snapshot read in the
-- acquiring statement could miss a take and release committed while it waited for the row.
ALTER TABLE adk_run_leases ADD COLUMN IF NOT EXISTS previous_end timestamptz;
