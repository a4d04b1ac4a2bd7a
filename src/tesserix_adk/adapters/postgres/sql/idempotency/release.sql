-- idempotency/release: Drop a ttl claim held by the holder (or an undispatched claim);
-- anything else is left alone.
-- Parameters: tenant, key, holder, undispatched.
-- Returns: No rows.
DELETE FROM adk_idempotency
WHERE tenant = %(tenant)s AND key = %(key)s AND status = 'in_flight' AND holder = %(holder)s
  AND (expires_at IS NOT NULL OR %(undispatched)s)
