-- idempotency/complete: Record the outcome of an in-flight claim by its holder (not fenced).
-- Parameters: tenant, key, holder, outcome.
-- Returns: changed (this statement completed it), lapsed (the claim's ttl ran out) and the
-- record; no row if there is none.
WITH now_ AS (SELECT clock_timestamp() AS t),
done AS (
    UPDATE adk_idempotency AS r
    SET status = 'completed', outcome = %(outcome)s, completed_at = now_.t, expires_at = NULL
    FROM now_
    WHERE r.tenant = %(tenant)s AND r.key = %(key)s AND r.status = 'in_flight'
      AND r.holder = %(holder)s
      AND NOT (r.status = 'in_flight' AND r.expires_at IS NOT NULL AND r.expires_at <= now_.t)
    RETURNING r.key, r.status, r.holder, r.tenant, r.run_id, r.iteration, r.tool, r.call_id,
        r.side_effects, r.idempotent, r.fence, r.outcome,
        extract(epoch FROM r.since)::float8 AS since,
        extract(epoch FROM r.completed_at)::float8 AS completed_at,
        extract(epoch FROM r.expires_at)::float8 AS expires_at, r.resolved_by,
    r.never_ran_by, r.holder_run, r.holder_iteration, r.holder_call_id
)
SELECT true AS changed, false AS lapsed, done.* FROM done
UNION ALL
SELECT false, (r.status = 'in_flight' AND r.expires_at IS NOT NULL AND r.expires_at <= now_.t),
    r.key, r.status, r.holder, r.tenant, r.run_id, r.iteration, r.tool, r.call_id,
    r.side_effects, r.idempotent, r.fence, r.outcome,
    extract(epoch FROM r.since)::float8 AS since,
    extract(epoch FROM r.completed_at)::float8 AS completed_at,
    extract(epoch FROM r.expires_at)::float8 AS expires_at, r.resolved_by,
    r.never_ran_by, r.holder_run, r.holder_iteration, r.holder_call_id
FROM adk_idempotency AS r, now_
WHERE r.tenant = %(tenant)s AND r.key = %(key)s AND NOT EXISTS (SELECT 1 FROM done)
