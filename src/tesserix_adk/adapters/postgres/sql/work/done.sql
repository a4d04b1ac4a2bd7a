-- work/done: The run wants no worker now; the row (and so its submission) stays. A run the
-- index does not hold is left unknown.
-- Parameters: tenant, run_id.
-- Returns: No rows.
UPDATE adk_work
SET state = 'done', since = clock_timestamp(), not_before = NULL, reason = NULL, attempts = 0
WHERE tenant = %(tenant)s AND run_id = %(run_id)s
