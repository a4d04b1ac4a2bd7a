-- leases/renew: Extend a live lease for its holder at its fence.
-- Parameters: tenant, run_id, holder, fence, ttl.
-- Returns: The new expires_at; no row if the lease lapsed or was taken.
UPDATE adk_run_leases
SET expires_at = clock_timestamp() + make_interval(secs => %(ttl)s::float8)
WHERE tenant = %(tenant)s AND run_id = %(run_id)s AND holder = %(holder)s
  AND fence = %(fence)s::bigint AND expires_at > clock_timestamp()
RETURNING extract(epoch FROM expires_at)::float8 AS expires_at
