-- work/wake: A parked run woken as it was read (of agent, with attempts counted and parked
-- for reason): it becomes wanted now with one more attempt counted and no reason, in one
-- write, so the count goes on. An entry changed since it was read is left as it is.
-- Parameters: tenant, run_id, agent, attempts, reason (NULL for none).
-- Returns: One row (woken) when it was written, no rows otherwise.
UPDATE adk_work
SET state = 'wanted', since = clock_timestamp(), not_before = NULL,
    attempts = attempts + 1, reason = NULL
WHERE tenant = %(tenant)s AND run_id = %(run_id)s AND state = 'parked' AND agent = %(agent)s
  AND attempts = %(attempts)s::int4 AND reason IS NOT DISTINCT FROM %(reason)s::text
RETURNING true AS woken
