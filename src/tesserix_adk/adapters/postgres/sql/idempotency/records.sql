-- idempotency/records: Every live record of the run: its own, then those it took over.
-- Parameters: tenant, run_id.
-- Returns: One row per live record, unordered (the store orders them as the run lists them).
-- A call the run took over from another run is found by adk_idempotency_taken.
WITH now_ AS (SELECT clock_timestamp() AS t)
SELECT r.key, r.status, r.holder, r.tenant, r.run_id, r.iteration, r.tool, r.call_id,
    r.side_effects, r.idempotent, r.fence, r.outcome,
    extract(epoch FROM r.since)::float8 AS since,
    extract(epoch FROM r.completed_at)::float8 AS completed_at,
    extract(epoch FROM r.expires_at)::float8 AS expires_at, r.resolved_by,
    r.never_ran_by, r.holder_run, r.holder_iteration, r.holder_call_id
FROM adk_idempotency AS r, now_
WHERE r.tenant = %(tenant)s AND r.run_id = %(run_id)s
  AND NOT (r.status = 'in_flight' AND r.expires_at IS NOT NULL AND r.expires_at <= now_.t)
UNION ALL
SELECT r.key, r.status, r.holder, r.tenant, r.run_id, r.iteration, r.tool, r.call_id,
    r.side_effects, r.idempotent, r.fence, r.outcome,
    extract(epoch FROM r.since)::float8 AS since,
    extract(epoch FROM r.completed_at)::float8 AS completed_at,
    extract(epoch FROM r.expires_at)::float8 AS expires_at, r.resolved_by,
    r.never_ran_by, r.holder_run, r.holder_iteration, r.holder_call_id
FROM adk_idempotency AS r, now_
WHERE r.tenant = %(tenant)s AND r.holder_run = %(run_id)s AND r.run_id <> %(run_id)s
  AND NOT (r.status = 'in_flight' AND r.expires_at IS NOT NULL AND r.expires_at <= now_.t)
