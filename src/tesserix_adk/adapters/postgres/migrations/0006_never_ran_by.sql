-- A call claimed again after an operator (or a reconciler) said it never ran keeps who said
-- so (never_ran_by), through its new claim and its outcome: that word is what let it go out
-- a second time, and `tesserix show` names it.
ALTER TABLE adk_idempotency ADD COLUMN IF NOT EXISTS never_ran_by text;
