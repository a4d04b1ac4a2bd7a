-- append: append to a run's transcript after the prefix of ARGV[2] items ending in digest
-- ARGV[3], dropping any tail beyond it.
-- KEYS: [1] items, [2] digests, [3] seen fence, [4] lease fence.
-- ARGV: [1] fence ('' = unfenced), [2] count, [3] digest, [4] empty digest, [5] n,
--       [6 .. 5+n] the new items, [6+n .. 5+2n] their digests.
-- Returns {'ok'}, {'stale', refusing fence}, {'unavailable'} (the prefix does not
-- resolve) or {'damaged', key} (a key of the run holds another type: nothing is written).
local refused = refusal(KEYS[3], KEYS[4], ARGV[1])
if refused then return {'stale', refused} end
local count = tonumber(ARGV[2])
if not resolves(KEYS[2], count, ARGV[3], ARGV[4]) then return {'unavailable'} end
local wrong = mistyped({KEYS[1], KEYS[2]}, {'list', 'list'})
if wrong then return {'damaged', wrong} end
accept(KEYS[3], ARGV[1])
append_after(KEYS[1], KEYS[2], count, 6, tonumber(ARGV[5]))
return {'ok'}
