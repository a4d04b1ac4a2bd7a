-- checkpoints/put: Write a frontier and its step snapshot, if the fence passes the gate.
-- Parameters: tenant, run_id, fence, step, payload.
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
    FROM gate
    ON CONFLICT (tenant, run_id, step) DO UPDATE SET
        fence = EXCLUDED.fence, payload = EXCLUDED.payload
)
SELECT
    EXISTS (SELECT 1 FROM gate) AS accepted,
    (SELECT fence FROM adk_fences
      WHERE store = 'checkpoints' AND tenant = %(tenant)s AND run_id = %(run_id)s) AS seen,
    (SELECT fence FROM lease) AS leased
