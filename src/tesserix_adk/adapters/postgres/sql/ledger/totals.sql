-- ledger/totals: The micros and tokens charged to the run.
-- Parameters: tenant, run_id.
-- Returns: At most one row.
SELECT micros, input_tokens, output_tokens FROM adk_ledger
WHERE tenant = %(tenant)s AND run_id = %(run_id)s
