-- idempotency/claim_unfenced: Claim a key for a run (taken before any lease exists: never fenced).
-- Parameters: key, holder, tenant, run_id, iteration, tool, call_id, side_effects,
--   idempotent, claim_fence (NULL), ttl (NULL: the claim never lapses), takeover.
-- Returns: The record as it stands after the claim.
WITH now_ AS (SELECT clock_timestamp() AS t),
gate AS (SELECT 1),
claimed AS (
    INSERT INTO adk_idempotency AS r (key, status, holder, tenant, run_id, iteration, tool,
        call_id, side_effects, idempotent, fence, outcome, since, completed_at, expires_at,
        resolved_by)
    SELECT %(key)s, 'in_flight', %(holder)s, %(tenant)s, %(run_id)s, %(iteration)s::integer,
        %(tool)s, %(call_id)s, %(side_effects)s::boolean, %(idempotent)s::boolean,
        %(claim_fence)s::bigint, NULL, now_.t, NULL,
        now_.t + make_interval(secs => %(ttl)s::float8), NULL
    FROM now_ WHERE EXISTS (SELECT 1 FROM gate)
    ON CONFLICT (tenant, key) DO UPDATE SET
        -- What the claim leaves in each column: a fresh record's value (none was there, it
        -- never ran, or it was a ttl claim that lapsed), a takeover's (another holder's claim
        -- in flight, with takeover) or a renewal's (the holder's own), else the record's own
        -- (a completed record, or another holder's without takeover). The record is always
        -- updated, also when nothing changes, so that RETURNING hands back the record as it
        -- stands after the claim in the same statement.
        status = CASE
            WHEN (r.status = 'never_ran' OR (r.status = 'in_flight'
                  AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                THEN EXCLUDED.status
            ELSE r.status END,
        holder = CASE
            WHEN (r.status = 'never_ran' OR (r.status = 'in_flight'
                  AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                THEN EXCLUDED.holder
            WHEN (NOT (r.status = 'never_ran' OR (r.status = 'in_flight'
                       AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                  AND r.status = 'in_flight' AND r.holder <> EXCLUDED.holder
                  AND %(takeover)s::boolean)
                THEN EXCLUDED.holder
            ELSE r.holder END,
        run_id = CASE
            WHEN (r.status = 'never_ran' OR (r.status = 'in_flight'
                  AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                THEN EXCLUDED.run_id
            ELSE r.run_id END,
        iteration = CASE
            WHEN (r.status = 'never_ran' OR (r.status = 'in_flight'
                  AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                THEN EXCLUDED.iteration
            ELSE r.iteration END,
        tool = CASE
            WHEN (r.status = 'never_ran' OR (r.status = 'in_flight'
                  AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                THEN EXCLUDED.tool
            ELSE r.tool END,
        call_id = CASE
            WHEN (r.status = 'never_ran' OR (r.status = 'in_flight'
                  AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                THEN EXCLUDED.call_id
            ELSE r.call_id END,
        side_effects = CASE
            WHEN (r.status = 'never_ran' OR (r.status = 'in_flight'
                  AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                THEN EXCLUDED.side_effects
            ELSE r.side_effects END,
        idempotent = CASE
            WHEN (r.status = 'never_ran' OR (r.status = 'in_flight'
                  AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                THEN EXCLUDED.idempotent
            ELSE r.idempotent END,
        outcome = CASE
            WHEN (r.status = 'never_ran' OR (r.status = 'in_flight'
                  AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                THEN EXCLUDED.outcome
            ELSE r.outcome END,
        completed_at = CASE
            WHEN (r.status = 'never_ran' OR (r.status = 'in_flight'
                  AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                THEN EXCLUDED.completed_at
            ELSE r.completed_at END,
        resolved_by = CASE
            WHEN (r.status = 'never_ran' OR (r.status = 'in_flight'
                  AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                THEN EXCLUDED.resolved_by
            ELSE r.resolved_by END,
        -- Who said it never ran, kept on the new claim; a ttl claim that lapsed keeps none.
        never_ran_by = CASE
            WHEN r.status = 'never_ran' THEN r.resolved_by
            WHEN (r.status = 'in_flight' AND r.expires_at IS NOT NULL
                  AND r.expires_at <= EXCLUDED.since)
                THEN NULL
            ELSE r.never_ran_by END,
        -- The run whose holder took the claim over, with its turn and call id, unless it is
        -- the record's own run; a fresh claim is its own run's.
        holder_run = CASE
            WHEN (r.status = 'never_ran' OR (r.status = 'in_flight'
                  AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                THEN NULL
            WHEN (r.status = 'in_flight' AND r.holder <> EXCLUDED.holder
                  AND %(takeover)s::boolean)
                THEN NULLIF(EXCLUDED.run_id, r.run_id)
            ELSE r.holder_run END,
        holder_iteration = CASE
            WHEN (r.status = 'never_ran' OR (r.status = 'in_flight'
                  AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                THEN NULL
            WHEN (r.status = 'in_flight' AND r.holder <> EXCLUDED.holder
                  AND %(takeover)s::boolean)
                THEN CASE WHEN EXCLUDED.run_id = r.run_id THEN NULL ELSE EXCLUDED.iteration END
            ELSE r.holder_iteration END,
        holder_call_id = CASE
            WHEN (r.status = 'never_ran' OR (r.status = 'in_flight'
                  AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                THEN NULL
            WHEN (r.status = 'in_flight' AND r.holder <> EXCLUDED.holder
                  AND %(takeover)s::boolean)
                THEN CASE WHEN EXCLUDED.run_id = r.run_id THEN NULL ELSE EXCLUDED.call_id END
            ELSE r.holder_call_id END,
        fence = CASE
            WHEN (r.status = 'never_ran' OR (r.status = 'in_flight'
                  AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                THEN EXCLUDED.fence
            WHEN (NOT (r.status = 'never_ran' OR (r.status = 'in_flight'
                       AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                  AND r.status = 'in_flight' AND r.holder <> EXCLUDED.holder
                  AND %(takeover)s::boolean)
                THEN EXCLUDED.fence
            WHEN (NOT (r.status = 'never_ran' OR (r.status = 'in_flight'
                       AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                  AND r.status = 'in_flight' AND r.holder = EXCLUDED.holder)
                THEN COALESCE(EXCLUDED.fence, r.fence)
            ELSE r.fence END,
        since = CASE
            WHEN (r.status = 'never_ran' OR (r.status = 'in_flight'
                  AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                THEN EXCLUDED.since
            WHEN (NOT (r.status = 'never_ran' OR (r.status = 'in_flight'
                       AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                  AND r.status = 'in_flight' AND r.holder <> EXCLUDED.holder
                  AND %(takeover)s::boolean)
                THEN EXCLUDED.since
            ELSE r.since END,
        expires_at = CASE
            WHEN (r.status = 'never_ran' OR (r.status = 'in_flight'
                  AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                THEN EXCLUDED.expires_at
            WHEN (NOT (r.status = 'never_ran' OR (r.status = 'in_flight'
                       AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                  AND r.status = 'in_flight' AND r.holder <> EXCLUDED.holder
                  AND %(takeover)s::boolean)
                THEN EXCLUDED.expires_at
            WHEN (NOT (r.status = 'never_ran' OR (r.status = 'in_flight'
                       AND r.expires_at IS NOT NULL AND r.expires_at <= EXCLUDED.since))
                  AND r.status = 'in_flight' AND r.holder = EXCLUDED.holder)
                THEN COALESCE(EXCLUDED.expires_at, r.expires_at)
            ELSE r.expires_at END
    RETURNING r.key, r.status, r.holder, r.tenant, r.run_id, r.iteration, r.tool, r.call_id,
        r.side_effects, r.idempotent, r.fence, r.outcome,
        extract(epoch FROM r.since)::float8 AS since,
        extract(epoch FROM r.completed_at)::float8 AS completed_at,
        extract(epoch FROM r.expires_at)::float8 AS expires_at, r.resolved_by,
    r.never_ran_by, r.holder_run, r.holder_iteration, r.holder_call_id
)
SELECT * FROM claimed
