-- checkpoints/latest: The run's frontier: the last accepted put.
-- Parameters: tenant, run_id.
-- Returns: At most one row: payload, step, fence.
SELECT payload, step, fence FROM adk_checkpoints
WHERE tenant = %(tenant)s AND run_id = %(run_id)s
