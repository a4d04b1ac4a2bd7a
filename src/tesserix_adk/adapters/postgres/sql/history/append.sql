-- history/append: Append messages after a prefix, dropping a dead writer's tail beyond it.
-- The prefix resolves when its last message carries its digest (the empty prefix always
-- does). Only then may the gate pass; a refusal for that reason raises no fence.
-- Parameters: tenant, run_id, fence, count, digest (the prefix's), empty (the empty
--   prefix's digest), items, digests (the chained digest after each item).
-- Returns: resolves (whether the prefix resolved), accepted, seen and leased.
WITH prefix AS (
    SELECT CASE WHEN %(count)s::integer = 0 THEN %(digest)s = %(empty)s
                ELSE EXISTS (SELECT 1 FROM adk_history
                             WHERE tenant = %(tenant)s AND run_id = %(run_id)s
                               AND position = %(count)s::integer - 1
                               AND digest = %(digest)s)
           END AS resolves
),
lease AS (
    SELECT fence FROM adk_run_leases WHERE tenant = %(tenant)s AND run_id = %(run_id)s
),
gate AS (
    INSERT INTO adk_fences AS f (store, tenant, run_id, fence)
    SELECT 'history', %(tenant)s, %(run_id)s, %(fence)s::bigint
    WHERE CASE WHEN %(fence)s::bigint IS NULL THEN NOT EXISTS (SELECT 1 FROM lease)
               ELSE %(fence)s::bigint >= COALESCE((SELECT fence FROM lease), %(fence)s::bigint)
          END
          AND (SELECT resolves FROM prefix)
    ON CONFLICT (store, tenant, run_id) DO UPDATE SET fence = GREATEST(f.fence, EXCLUDED.fence)
    WHERE (EXCLUDED.fence IS NULL AND f.fence IS NULL)
       OR (EXCLUDED.fence IS NOT NULL AND (f.fence IS NULL OR f.fence <= EXCLUDED.fence))
    RETURNING 1
),
dropped AS (
    -- A dead writer may have appended past this prefix; its tail goes.
    DELETE FROM adk_history
    WHERE tenant = %(tenant)s AND run_id = %(run_id)s
      AND position >= %(count)s::integer + cardinality(%(items)s::bytea[])
      AND EXISTS (SELECT 1 FROM gate)
),
added AS (
    INSERT INTO adk_history (tenant, run_id, position, digest, item)
    SELECT %(tenant)s, %(run_id)s, %(count)s::integer + (new.n - 1)::integer, new.digest,
           new.item
    FROM unnest(%(items)s::bytea[], %(digests)s::text[]) WITH ORDINALITY
         AS new(item, digest, n)
    WHERE EXISTS (SELECT 1 FROM gate)
    ON CONFLICT (tenant, run_id, position) DO UPDATE SET
        digest = EXCLUDED.digest, item = EXCLUDED.item
)
SELECT (SELECT resolves FROM prefix) AS resolves,
    EXISTS (SELECT 1 FROM gate) AS accepted,
    (SELECT fence FROM adk_fences
      WHERE store = 'history' AND tenant = %(tenant)s AND run_id = %(run_id)s) AS seen,
    (SELECT fence FROM lease) AS leased
