-- approvals/get: One request of the tenant.
-- Parameters: tenant, id.
-- Returns: At most one row.
SELECT a.id, a.tenant, a.run_id, a.calls::text AS calls, a.iteration, a.status,
    a.decided_by, a.note, extract(epoch FROM a.requested_at)::float8 AS requested_at,
    extract(epoch FROM a.decided_at)::float8 AS decided_at
FROM adk_approvals AS a
WHERE a.id = %(id)s AND a.tenant = %(tenant)s
