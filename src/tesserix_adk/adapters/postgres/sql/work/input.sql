-- work/input: The encoded input a run was submitted with.
-- Parameters: tenant, run_id.
-- Returns: At most one row: input (NULL for a run that was never submitted).
SELECT input FROM adk_work WHERE tenant = %(tenant)s AND run_id = %(run_id)s
