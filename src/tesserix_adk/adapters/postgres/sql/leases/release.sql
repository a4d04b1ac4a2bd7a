-- leases/release: Free the run, only for the holder at that fence. The row stays: its fence is
-- what the next acquisition counts on from, and expires_at keeps when the lease ended,
-- which that acquisition reports.
-- Parameters: tenant, run_id, holder, fence.
-- Returns: No rows.
UPDATE adk_run_leases
SET holder = NULL, expires_at = LEAST(expires_at, clock_timestamp())
WHERE tenant = %(tenant)s AND run_id = %(run_id)s AND holder = %(holder)s
  AND fence = %(fence)s::bigint
