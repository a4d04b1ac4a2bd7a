-- idempotency/resolve: An operator settles an in-flight call: its outcome, or that it never ran.
-- Parameters: tenant, key, never_ran, outcome, by, holder (NULL: whoever holds it).
-- Returns: changed (this statement settled it), lapsed (the claim's ttl ran out) and the
-- record; no row if there is none.
WITH now_ AS (SELECT clock_timestamp() AS t),
settled AS (
    UPDATE adk_idempotency AS r SET
        status = CASE WHEN %(never_ran)s::boolean THEN 'never_ran' ELSE 'completed' END,
        outcome = CASE WHEN %(never_ran)s::boolean THEN r.outcome ELSE %(outcome)s::bytea END,
        completed_at = CASE WHEN %(never_ran)s::boolean THEN r.completed_at ELSE now_.t END,
        expires_at = NULL,
        resolved_by = %(by)s
    FROM now_
    WHERE r.tenant = %(tenant)s AND r.key = %(key)s AND r.status = 'in_flight'
      AND (%(holder)s::text IS NULL OR r.holder = %(holder)s::text)
      AND NOT (r.status = 'in_flight' AND r.expires_at IS NOT NULL AND r.expires_at <= now_.t)
    RETURNING r.key, r.status, r.holder, r.tenant, r.run_id, r.iteration, r.tool, r.call_id,
        r.side_effects, r.idempotent, r.fence, r.outcome,
        extract(epoch FROM r.since)::float8 AS since,
        extract(epoch FROM r.completed_at)::float8 AS completed_at,
        extract(epoch FROM r.expires_at)::float8 AS expires_at, r.resolved_by,
    r.never_ran_by, r.holder_run, r.holder_iteration, r.holder_call_id
)
SELECT true AS changed, false AS lapsed, settled.* FROM settled
UNION ALL
SELECT false, (r.status = 'in_flight' AND r.expires_at IS NOT NULL AND r.expires_at <= now_.t),
    r.key, r.status, r.holder, r.tenant, r.run_id, r.iteration, r.tool, r.call_id,
    r.side_effects, r.idempotent, r.fence, r.outcome,
    extract(epoch FROM r.since)::float8 AS since,
    extract(epoch FROM r.completed_at)::float8 AS completed_at,
    extract(epoch FROM r.expires_at)::float8 AS expires_at, r.resolved_by,
    r.never_ran_by, r.holder_run, r.holder_iteration, r.holder_call_id
FROM adk_idempotency AS r, now_
WHERE r.tenant = %(tenant)s AND r.key = %(key)s AND NOT EXISTS (SELECT 1 FROM settled)
