-- history/fetch: The messages of a prefix, with their chained digests.
-- Parameters: tenant, run_id, count.
-- Returns: One row per message.
SELECT position, digest, item FROM adk_history
WHERE tenant = %(tenant)s AND run_id = %(run_id)s AND position < %(count)s::integer
ORDER BY position
