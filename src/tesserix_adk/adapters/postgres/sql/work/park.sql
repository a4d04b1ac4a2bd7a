-- work/park: The run must not be carried on until an operator acts; reason says why. Its
-- attempts and input are kept.
-- Parameters: tenant, run_id, agent, reason.
-- Returns: No rows.
INSERT INTO adk_work AS w (tenant, run_id, agent, state, since, reason)
VALUES (%(tenant)s, %(run_id)s, %(agent)s, 'parked', clock_timestamp(), %(reason)s)
ON CONFLICT (tenant, run_id) DO UPDATE SET
    agent = EXCLUDED.agent,
    state = 'parked',
    since = EXCLUDED.since,
    not_before = NULL,
    reason = EXCLUDED.reason
