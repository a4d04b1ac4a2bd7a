-- checkpoints/forget: Remove the run's frontier and steps; its fence stays.
-- Parameters: tenant, run_id.
-- Returns: No rows.
WITH frontier AS (
    DELETE FROM adk_checkpoints WHERE tenant = %(tenant)s AND run_id = %(run_id)s
)
DELETE FROM adk_checkpoint_steps WHERE tenant = %(tenant)s AND run_id = %(run_id)s
