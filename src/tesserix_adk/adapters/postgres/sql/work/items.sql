-- work/items: The entries of tenant (every tenant: NULL) in state (any but done: NULL),
-- oldest first.
-- Parameters: tenant, state.
-- Returns: tenant, run_id, agent, state, since, not_before, attempts, reason of each entry.
SELECT tenant, run_id, agent, state,
    extract(epoch FROM since)::float8 AS since,
    extract(epoch FROM not_before)::float8 AS not_before,
    attempts, reason
FROM adk_work
WHERE (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
  AND CASE WHEN %(state)s::text IS NULL THEN state <> 'done' ELSE state = %(state)s END
ORDER BY since, tenant, run_id
