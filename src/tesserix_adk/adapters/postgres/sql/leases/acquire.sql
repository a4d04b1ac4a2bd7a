-- leases/acquire: The one statement that decides an acquisition: a new run's row, or a lapsed or
-- released lease taken over at the next fence; a live lease leaves the row alone.
-- before reads, in the statement's snapshot, when the previous lease ended; the upsert
-- overwrites it and RETURNING sees only the new row. (Not FOR UPDATE: that would skip the
-- row this very statement updates.) If the upsert succeeds, any change committed since the
-- snapshot can only have been that lease's release, which moves its end earlier, so the
-- value read is never earlier than the true end.
-- Parameters: tenant, run_id, holder, ttl.
-- Returns: The new fence, expires_at and previous_end; no row if the lease is live.
WITH before AS (
    SELECT expires_at FROM adk_run_leases
    WHERE tenant = %(tenant)s AND run_id = %(run_id)s
)
INSERT INTO adk_run_leases AS l (tenant, run_id, fence, holder, expires_at)
VALUES (%(tenant)s, %(run_id)s, 1, %(holder)s,
        clock_timestamp() + make_interval(secs => %(ttl)s::float8))
ON CONFLICT (tenant, run_id) DO UPDATE SET
    fence = l.fence + 1,
    holder = EXCLUDED.holder,
    expires_at = clock_timestamp() + make_interval(secs => %(ttl)s::float8)
WHERE l.holder IS NULL OR l.expires_at <= clock_timestamp()
RETURNING l.fence, extract(epoch FROM l.expires_at)::float8 AS expires_at,
    extract(epoch FROM (SELECT expires_at FROM before))::float8 AS previous_end
