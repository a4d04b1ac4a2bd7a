-- work/want: The run wants a worker in state (decided, wanted or submitted), not before
-- delay seconds from now by the server's clock. It keeps its place (since) when it was in
-- that state already. A given count moves the count of attempts by that much (never below
-- 0); without one a delayed want counts one more attempt, a prompt one keeps the count in
-- the same state and starts it again in another (an operator unparking the run). A parked
-- run is unparked; its input stays.
-- Parameters: tenant, run_id, agent, state, delay (seconds; 0 for none), reason, count
-- (NULL for none).
-- Returns: No rows.
INSERT INTO adk_work AS w (tenant, run_id, agent, state, since, not_before, attempts, reason)
VALUES (
    %(tenant)s, %(run_id)s, %(agent)s, %(state)s, clock_timestamp(),
    CASE WHEN %(delay)s::float8 > 0
         THEN clock_timestamp() + make_interval(secs => %(delay)s::float8) END,
    CASE WHEN %(count)s::int4 IS NOT NULL THEN greatest(0, %(count)s::int4)
         WHEN %(delay)s::float8 > 0 THEN 1 ELSE 0 END,
    %(reason)s
)
ON CONFLICT (tenant, run_id) DO UPDATE SET
    agent = EXCLUDED.agent,
    state = EXCLUDED.state,
    since = CASE WHEN w.state = EXCLUDED.state THEN w.since ELSE EXCLUDED.since END,
    not_before = EXCLUDED.not_before,
    attempts = CASE WHEN %(count)s::int4 IS NOT NULL THEN greatest(0, w.attempts + %(count)s::int4)
                    WHEN %(delay)s::float8 > 0 THEN w.attempts + 1
                    WHEN w.state = EXCLUDED.state THEN w.attempts ELSE 0 END,
    reason = EXCLUDED.reason
-- A worker's count (a take, a give-back) never unparks a run or revives a finished one.
WHERE %(count)s::int4 IS NULL OR w.state NOT IN ('parked', 'done')
