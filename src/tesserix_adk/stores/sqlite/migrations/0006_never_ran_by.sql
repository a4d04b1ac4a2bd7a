-- Version 6: a call claimed again after an operator (or a reconciler) said it never ran
-- keeps who said so (never_ran_by), through its new claim and its outcome: that word is
-- what let it go out a second time, and `tesserix show` names it. A kit from before would
-- write its records without the column and drop the name, so the version rises.
ALTER TABLE adk_idempotency ADD COLUMN never_ran_by TEXT;
