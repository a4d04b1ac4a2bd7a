-- work/submit: Record a run as submitted with its encoded input, once per id: a run the
-- index knows in any state (done included) is left as it is.
-- Parameters: tenant, run_id, agent, input.
-- Returns: One row (recorded) if the run was new; none if it was known.
INSERT INTO adk_work (tenant, run_id, agent, state, since, input)
VALUES (%(tenant)s, %(run_id)s, %(agent)s, 'submitted', clock_timestamp(), %(input)s)
ON CONFLICT (tenant, run_id) DO NOTHING
RETURNING true AS recorded
