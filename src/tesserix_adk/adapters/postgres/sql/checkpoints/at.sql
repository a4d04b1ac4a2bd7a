-- checkpoints/at: The snapshot written under one step.
-- Parameters: tenant, run_id, step.
-- Returns: At most one row: payload, step, fence.
SELECT payload, step, fence FROM adk_checkpoint_steps
WHERE tenant = %(tenant)s AND run_id = %(run_id)s AND step = %(step)s::bigint
