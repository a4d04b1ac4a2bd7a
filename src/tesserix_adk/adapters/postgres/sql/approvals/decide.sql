-- approvals/decide: Decide a pending request.
-- Parameters: tenant, id, status, by, note.
-- Returns: changed (this statement decided it) and the request; no row if the tenant has
-- no request with that id.
WITH now_ AS (SELECT clock_timestamp() AS t),
decided AS (
    UPDATE adk_approvals AS a
    SET status = %(status)s, decided_by = %(by)s, note = %(note)s, decided_at = now_.t
    FROM now_
    WHERE a.id = %(id)s AND a.tenant = %(tenant)s AND a.status = 'pending'
    RETURNING a.id, a.tenant, a.run_id, a.calls::text AS calls, a.iteration, a.status,
        a.decided_by, a.note, extract(epoch FROM a.requested_at)::float8 AS requested_at,
        extract(epoch FROM a.decided_at)::float8 AS decided_at
)
SELECT true AS changed, decided.* FROM decided
UNION ALL
SELECT false, a.id, a.tenant, a.run_id, a.calls::text AS calls, a.iteration, a.status,
    a.decided_by, a.note, extract(epoch FROM a.requested_at)::float8 AS requested_at,
    extract(epoch FROM a.decided_at)::float8 AS decided_at
FROM adk_approvals AS a
WHERE a.id = %(id)s AND a.tenant = %(tenant)s AND NOT EXISTS (SELECT 1 FROM decided)
