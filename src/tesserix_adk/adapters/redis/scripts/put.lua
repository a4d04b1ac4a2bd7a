-- put: write a run's frontier, and the same payload as step ARGV[2], pruning to keep_last.
-- KEYS: [1] frontier, [2] steps, [3] step fences, [4] step index, [5] seen fence,
--       [6] lease fence.
-- ARGV: [1] fence ('' = unfenced), [2] step, [3] payload, [4] keep_last ('' = keep every
--       step).
-- Returns {'ok'}, {'stale', refusing fence} or {'damaged', key} (a key of the run holds
-- another type: nothing is written).
local refused = refusal(KEYS[5], KEYS[6], ARGV[1])
if refused then return {'stale', refused} end
local wrong = mistyped({KEYS[1], KEYS[2], KEYS[3], KEYS[4]}, {'hash', 'hash', 'hash', 'zset'})
if wrong then return {'damaged', wrong} end
accept(KEYS[5], ARGV[1])
put_frontier(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
return {'ok'}
