-- idempotency/records_from: The run's live tool-call records from an iteration on, outcomes left out.
-- Parameters: tenant, run_id, iteration.
-- Returns: One row per live record (outcome NULL), unordered (the store orders them).
-- What planning a resume reads: adk_idempotency_run_iteration finds the run's own rows
-- alone, and adk_idempotency_taken those it took over, however long the run already is.
WITH now_ AS (SELECT clock_timestamp() AS t)
SELECT r.key, r.status, r.holder, r.tenant, r.run_id, r.iteration, r.tool, r.call_id,
    r.side_effects, r.idempotent, r.fence, NULL::bytea AS outcome,
    extract(epoch FROM r.since)::float8 AS since,
    extract(epoch FROM r.completed_at)::float8 AS completed_at,
    extract(epoch FROM r.expires_at)::float8 AS expires_at, r.resolved_by,
    r.never_ran_by, r.holder_run, r.holder_iteration, r.holder_call_id
FROM adk_idempotency AS r, now_
WHERE r.tenant = %(tenant)s AND r.run_id = %(run_id)s AND r.iteration >= %(iteration)s::bigint
  AND r.tool IS NOT NULL
  AND NOT (r.status = 'in_flight' AND r.expires_at IS NOT NULL AND r.expires_at <= now_.t)
UNION ALL
SELECT r.key, r.status, r.holder, r.tenant, r.run_id, r.iteration, r.tool, r.call_id,
    r.side_effects, r.idempotent, r.fence, NULL::bytea AS outcome,
    extract(epoch FROM r.since)::float8 AS since,
    extract(epoch FROM r.completed_at)::float8 AS completed_at,
    extract(epoch FROM r.expires_at)::float8 AS expires_at, r.resolved_by,
    r.never_ran_by, r.holder_run, r.holder_iteration, r.holder_call_id
FROM adk_idempotency AS r, now_
WHERE r.tenant = %(tenant)s AND r.holder_run = %(run_id)s
  AND r.holder_iteration >= %(iteration)s::bigint AND r.run_id <> %(run_id)s
  AND r.tool IS NOT NULL
  AND NOT (r.status = 'in_flight' AND r.expires_at IS NOT NULL AND r.expires_at <= now_.t)
