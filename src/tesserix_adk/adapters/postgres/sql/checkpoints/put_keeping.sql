-- checkpoints/put_keeping: Write a frontier and its step snapshot, keeping the keep_last highest steps:
-- the new step joins the steps kept and only the highest stay (the new one too only
-- if it is among them, as a put then prune would leave it).
-- Parameters: tenant, run_id, fence, step, payload, keep_last.
-- Returns: One row: accepted (the gate let the write through), seen (the highest fence the
-- store has seen for the run) and leased (the run's lease fence).
WITH lease AS (
    SELECT fence FROM adk_run_leases WHERE tenant = %(tenant)s AND run_id = %(run_id)s
),
gate AS (
    INSERT INTO adk_fences AS f (store, tenant, run_id, fence)
    SELECT 'checkpoints', %(tenant)s, %(run_id)s, %(fence)s::bigint
    WHERE CASE WHEN %(fence)s::bigint IS NULL THEN NOT EXISTS (SELECT 1 FROM lease)
               ELSE %(fence)s::bigint >= COALESCE((SELECT fence FROM lease), %(fence)s::bigint)
          END
    ON CONFLICT (store, tenant, run_id) DO UPDATE SET fence = GREATEST(f.fence, EXCLUDED.fence)
    WHERE (EXCLUDED.fence IS NULL AND f.fence IS NULL)
       OR (EXCLUDED.fence IS NOT NULL AND (f.fence IS NULL OR f.fence <= EXCLUDED.fence))
    RETURNING 1
),
top AS (
    SELECT step FROM (
        SELECT step FROM adk_checkpoint_steps WHERE tenant = %(tenant)s AND run_id = %(run_id)s
        UNION SELECT %(step)s::bigint
    ) AS steps
    ORDER BY step DESC LIMIT %(keep_last)s::bigint
),
frontier AS (
    INSERT INTO adk_checkpoints (tenant, run_id, step, fence, payload, written_at)
    SELECT %(tenant)s, %(run_id)s, %(step)s::bigint, %(fence)s::bigint, %(payload)s,
           clock_timestamp()
    FROM gate
    ON CONFLICT (tenant, run_id) DO UPDATE SET
        step = EXCLUDED.step, fence = EXCLUDED.fence, payload = EXCLUDED.payload,
        written_at = EXCLUDED.written_at
),
snapshot AS (
    INSERT INTO adk_checkpoint_steps (tenant, run_id, step, fence, payload)
    SELECT %(tenant)s, %(run_id)s, %(step)s::bigint, %(fence)s::bigint, %(payload)s
    FROM gate WHERE %(step)s::bigint IN (SELECT step FROM top)
    ON CONFLICT (tenant, run_id, step) DO UPDATE SET
        fence = EXCLUDED.fence, payload = EXCLUDED.payload
),
pruned AS (
    DELETE FROM adk_checkpoint_steps
    WHERE tenant = %(tenant)s AND run_id = %(run_id)s
      AND step NOT IN (SELECT step FROM top) AND EXISTS (SELECT 1 FROM gate)
)
SELECT
    EXISTS (SELECT 1 FROM gate) AS accepted,
    (SELECT fence FROM adk_fences
      WHERE store = 'checkpoints' AND tenant = %(tenant)s AND run_id = %(run_id)s) AS seen,
    (SELECT fence FROM lease) AS leased
