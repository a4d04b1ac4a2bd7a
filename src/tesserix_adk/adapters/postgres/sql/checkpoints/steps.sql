-- checkpoints/steps: The steps still kept for the run, ascending.
-- Parameters: tenant, run_id.
-- Returns: One row per step.
SELECT step FROM adk_checkpoint_steps
WHERE tenant = %(tenant)s AND run_id = %(run_id)s ORDER BY step
