-- leases/live: The lease live by the server's clock.
-- Parameters: tenant, run_id.
-- Returns: At most one row: holder, fence, expires_at.
SELECT holder, fence, extract(epoch FROM expires_at)::float8 AS expires_at
FROM adk_run_leases
WHERE tenant = %(tenant)s AND run_id = %(run_id)s
  AND holder IS NOT NULL AND expires_at > clock_timestamp()
