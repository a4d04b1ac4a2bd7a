-- history/forget: Remove the run's transcript; its fence stays.
-- Parameters: tenant, run_id.
-- Returns: No rows.
DELETE FROM adk_history WHERE tenant = %(tenant)s AND run_id = %(run_id)s
