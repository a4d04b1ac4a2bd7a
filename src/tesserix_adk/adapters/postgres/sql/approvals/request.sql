-- approvals/request: Record a pending approval request, once per id, if the fence passes the gate.
-- Parameters: tenant, run_id, fence, id, calls, iteration.
-- Returns: accepted, seen, leased and the request made (all NULL if the gate refused it
-- or the id was taken).
WITH lease AS (
    SELECT fence FROM adk_run_leases WHERE tenant = %(tenant)s AND run_id = %(run_id)s
),
gate AS (
    INSERT INTO adk_fences AS f (store, tenant, run_id, fence)
    SELECT 'approvals', %(tenant)s, %(run_id)s, %(fence)s::bigint
    WHERE CASE WHEN %(fence)s::bigint IS NULL THEN NOT EXISTS (SELECT 1 FROM lease)
               ELSE %(fence)s::bigint >= COALESCE((SELECT fence FROM lease), %(fence)s::bigint)
          END
    ON CONFLICT (store, tenant, run_id) DO UPDATE SET fence = GREATEST(f.fence, EXCLUDED.fence)
    WHERE (EXCLUDED.fence IS NULL AND f.fence IS NULL)
       OR (EXCLUDED.fence IS NOT NULL AND (f.fence IS NULL OR f.fence <= EXCLUDED.fence))
    RETURNING 1
),
made AS (
    INSERT INTO adk_approvals AS a (id, tenant, run_id, calls, iteration, status, requested_at)
    SELECT %(id)s, %(tenant)s, %(run_id)s, %(calls)s::json, %(iteration)s::integer, 'pending',
           clock_timestamp()
    FROM gate
    ON CONFLICT (id) DO NOTHING
    RETURNING a.id, a.tenant, a.run_id, a.calls::text AS calls, a.iteration, a.status,
        a.decided_by, a.note, extract(epoch FROM a.requested_at)::float8 AS requested_at,
        extract(epoch FROM a.decided_at)::float8 AS decided_at
)
SELECT
    EXISTS (SELECT 1 FROM gate) AS accepted,
    (SELECT fence FROM adk_fences
      WHERE store = 'approvals' AND tenant = %(tenant)s AND run_id = %(run_id)s) AS seen,
    (SELECT fence FROM lease) AS leased, made.*
FROM (SELECT 1) AS one LEFT JOIN made ON true
