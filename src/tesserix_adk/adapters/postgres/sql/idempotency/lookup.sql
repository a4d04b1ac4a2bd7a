-- idempotency/lookup: The tenant's live records of some keys (a lapsed ttl claim is not live).
-- Parameters: tenant, keys.
-- Returns: One row per live record.
WITH now_ AS (SELECT clock_timestamp() AS t)
SELECT r.key, r.status, r.holder, r.tenant, r.run_id, r.iteration, r.tool, r.call_id,
    r.side_effects, r.idempotent, r.fence, r.outcome,
    extract(epoch FROM r.since)::float8 AS since,
    extract(epoch FROM r.completed_at)::float8 AS completed_at,
    extract(epoch FROM r.expires_at)::float8 AS expires_at, r.resolved_by,
    r.never_ran_by, r.holder_run, r.holder_iteration, r.holder_call_id
FROM adk_idempotency AS r, now_
WHERE r.tenant = %(tenant)s AND r.key = ANY(%(keys)s::text[])
  AND NOT (r.status = 'in_flight' AND r.expires_at IS NOT NULL AND r.expires_at <= now_.t)
