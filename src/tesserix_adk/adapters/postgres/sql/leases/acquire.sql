-- leases/acquire: The one statement that decides an acquisition: a new run's row, or a lapsed or
-- released lease taken over at the next fence; a live lease leaves the row alone.
-- previous_end is set from the row the upsert locked (its latest version), so it is the
-- end of the lease just before this one even when another holder took and released the
-- run while this statement waited for the row.
-- The next fence is above every fence the run's stores have seen too: a lease row lost (a
-- DELETE, a table restored on its own from an older dump) must never hand out again a fence
-- a holder still carries.
-- Parameters: tenant, run_id, holder, ttl.
-- Returns: The new fence, expires_at and previous_end; no row if the lease is live.
WITH seen AS (
    SELECT COALESCE(max(fence), 0) AS fence FROM adk_fences
    WHERE store IN ('checkpoints', 'history', 'idempotency', 'ledger', 'approvals')
      AND tenant = %(tenant)s AND run_id = %(run_id)s
)
INSERT INTO adk_run_leases AS l (tenant, run_id, fence, holder, expires_at, previous_end)
VALUES (%(tenant)s, %(run_id)s, (SELECT fence FROM seen) + 1, %(holder)s,
        clock_timestamp() + make_interval(secs => %(ttl)s::float8), NULL)
ON CONFLICT (tenant, run_id) DO UPDATE SET
    fence = GREATEST(l.fence, (SELECT fence FROM seen)) + 1,
    holder = EXCLUDED.holder,
    expires_at = clock_timestamp() + make_interval(secs => %(ttl)s::float8),
    previous_end = l.expires_at
WHERE l.holder IS NULL OR l.expires_at <= clock_timestamp()
RETURNING l.fence, extract(epoch FROM l.expires_at)::float8 AS expires_at,
    extract(epoch FROM l.previous_end)::float8 AS previous_end
