-- checkpoints/runs: The runs with a frontier for a tenant, by code point.
-- Parameters: tenant.
-- Returns: One row per run.
SELECT run_id FROM adk_checkpoints WHERE tenant = %(tenant)s
ORDER BY run_id COLLATE "C"
