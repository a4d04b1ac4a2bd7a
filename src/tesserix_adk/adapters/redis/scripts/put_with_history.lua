-- put_with_history: append.lua, then put.lua, for one run in one script: both are written
-- or neither. The append's refusals come first, as they would written one after the other.
-- KEYS: [1] items, [2] digests, [3] the transcript's seen fence, [4] frontier, [5] steps,
--       [6] step fences, [7] step index, [8] the frontier's seen fence, [9] lease fence.
-- ARGV: [1] fence ('' = unfenced), [2] step, [3] payload, [4] keep_last ('' = keep every
--       step), [5] count, [6] digest, [7] empty digest, [8] n, [9 .. 8+n] the new items,
--       [9+n .. 8+2n] their digests.
-- Returns {'ok'}, {'stale', 'append' or 'write', refusing fence}, {'unavailable'} or
-- {'damaged', key} (a key of the run holds another type: nothing is written).
local refused = refusal(KEYS[3], KEYS[9], ARGV[1])
if refused then return {'stale', 'append', refused} end
local count = tonumber(ARGV[5])
if not resolves(KEYS[2], count, ARGV[6], ARGV[7]) then return {'unavailable'} end
refused = refusal(KEYS[8], KEYS[9], ARGV[1])
if refused then return {'stale', 'write', refused} end
local wrong = mistyped({KEYS[1], KEYS[2], KEYS[4], KEYS[5], KEYS[6], KEYS[7]},
                       {'list', 'list', 'hash', 'hash', 'hash', 'zset'})
if wrong then return {'damaged', wrong} end
accept(KEYS[3], ARGV[1])
accept(KEYS[8], ARGV[1])
append_after(KEYS[1], KEYS[2], count, 9, tonumber(ARGV[8]))
put_frontier(KEYS[4], KEYS[5], KEYS[6], KEYS[7], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
return {'ok'}
