-- work/due: Up to row_limit runs a worker may take now, in take order (decided, wanted,
-- submitted; oldest first within each). head reads at most scan entries from the head of
-- adk_work_due (agents NULL: every agent) or of adk_work_due_by_agent for each agent
-- asked for, and no other row: the bound on what one call reads however many runs there
-- are. Of those, a run is due when it is past not_before and has no lease live by
-- clock_timestamp(), read from adk_run_leases in this same statement; so runs held by
-- workers or backing off are skipped without using up row_limit, as long as fewer than
-- scan minus row_limit of them come first.
-- Parameters: row_limit, scan (entries read from a head; at least row_limit), agents.
-- Returns: tenant, run_id, agent, state, since, not_before, attempts, reason of each run.
WITH now AS (SELECT clock_timestamp() AS t),
head AS (
    (
        SELECT tenant, run_id, agent, state, take_order, since, not_before, attempts, reason
        FROM adk_work
        WHERE %(agents)s::text[] IS NULL AND take_order IS NOT NULL
        ORDER BY take_order, since, tenant, run_id
        LIMIT %(scan)s::bigint
    )
    UNION ALL
    SELECT w.*
    FROM (SELECT DISTINCT unnest(%(agents)s::text[]) AS agent) AS asked,
    LATERAL (
        SELECT tenant, run_id, agent, state, take_order, since, not_before, attempts, reason
        FROM adk_work
        WHERE agent = asked.agent AND take_order IS NOT NULL
        ORDER BY take_order, since, tenant, run_id
        LIMIT %(scan)s::bigint
    ) AS w
)
SELECT h.tenant, h.run_id, h.agent, h.state,
    extract(epoch FROM h.since)::float8 AS since,
    extract(epoch FROM h.not_before)::float8 AS not_before,
    h.attempts, h.reason
FROM head AS h, now
WHERE (h.not_before IS NULL OR h.not_before <= now.t)
  AND NOT EXISTS (
      SELECT 1 FROM adk_run_leases AS l
      WHERE l.tenant = h.tenant AND l.run_id = h.run_id
        AND l.holder IS NOT NULL AND l.expires_at > now.t
  )
ORDER BY h.take_order, h.since, h.tenant, h.run_id
LIMIT %(row_limit)s::bigint
