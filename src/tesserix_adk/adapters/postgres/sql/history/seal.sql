-- history/seal: Raise the highest fence the history store has seen for the run, writing no data.
-- Parameters: tenant, run_id, fence.
-- Returns: One row: accepted (the gate let the write through), seen (the highest fence the
-- store has seen for the run) and leased (the run's lease fence).
WITH lease AS (
    SELECT fence FROM adk_run_leases WHERE tenant = %(tenant)s AND run_id = %(run_id)s
),
gate AS (
    INSERT INTO adk_fences AS f (store, tenant, run_id, fence)
    SELECT 'history', %(tenant)s, %(run_id)s, %(fence)s::bigint
    WHERE CASE WHEN %(fence)s::bigint IS NULL THEN NOT EXISTS (SELECT 1 FROM lease)
               ELSE %(fence)s::bigint >= COALESCE((SELECT fence FROM lease), %(fence)s::bigint)
          END
    ON CONFLICT (store, tenant, run_id) DO UPDATE SET fence = GREATEST(f.fence, EXCLUDED.fence)
    WHERE (EXCLUDED.fence IS NULL AND f.fence IS NULL)
       OR (EXCLUDED.fence IS NOT NULL AND (f.fence IS NULL OR f.fence <= EXCLUDED.fence))
    RETURNING 1
)
SELECT
    EXISTS (SELECT 1 FROM gate) AS accepted,
    (SELECT fence FROM adk_fences
      WHERE store = 'history' AND tenant = %(tenant)s AND run_id = %(run_id)s) AS seen,
    (SELECT fence FROM lease) AS leased
