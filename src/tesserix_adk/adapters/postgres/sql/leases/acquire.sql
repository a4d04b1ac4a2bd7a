-- leases/acquire: The one statement that decides an acquisition: a new run's row, or a lapsed or
-- released lease taken over at the next fence; a live lease leaves the row alone.
-- previous_end is set from the row the upsert locked (its latest version), so it is the
-- end of the lease just before this one even when another holder took and released the
-- run while this statement waited for the row.
-- Parameters: tenant, run_id, holder, ttl.
-- Returns: The new fence, expires_at and previous_end; no row if the lease is live.
INSERT INTO adk_run_leases AS l (tenant, run_id, fence, holder, expires_at, previous_end)
VALUES (%(tenant)s, %(run_id)s, 1, %(holder)s,
        clock_timestamp() + make_interval(secs => %(ttl)s::float8), NULL)
ON CONFLICT (tenant, run_id) DO UPDATE SET
    fence = l.fence + 1,
    holder = EXCLUDED.holder,
    expires_at = clock_timestamp() + make_interval(secs => %(ttl)s::float8),
    previous_end = l.expires_at
WHERE l.holder IS NULL OR l.expires_at <= clock_timestamp()
RETURNING l.fence, extract(epoch FROM l.expires_at)::float8 AS expires_at,
    extract(epoch FROM l.previous_end)::float8 AS previous_end
