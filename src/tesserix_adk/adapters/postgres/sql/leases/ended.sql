-- leases/ended: Seconds since the run's last lease ended.
-- Parameters: tenant, run_id.
-- Returns: At most one row: ago; none if a lease is live or none ever ended.
SELECT extract(epoch FROM clock_timestamp() - expires_at)::float8 AS ago
FROM adk_run_leases
WHERE tenant = %(tenant)s AND run_id = %(run_id)s
  AND expires_at IS NOT NULL AND (holder IS NULL OR expires_at <= clock_timestamp())
