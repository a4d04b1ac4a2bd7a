-- work/entry: One run's entry in whatever state, done included.
-- Parameters: tenant, run_id.
-- Returns: At most one row: tenant, run_id, agent, state, since, not_before, attempts, reason.
SELECT tenant, run_id, agent, state,
    extract(epoch FROM since)::float8 AS since,
    extract(epoch FROM not_before)::float8 AS not_before,
    attempts, reason
FROM adk_work
WHERE tenant = %(tenant)s AND run_id = %(run_id)s
