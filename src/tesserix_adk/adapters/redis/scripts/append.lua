-- append: append to a run's transcript after the prefix of ARGV[2] items ending in digest
-- ARGV[3], dropping any tail beyond it.
-- KEYS: [1] items, [2] digests, [3] seen fence, [4] lease fence.
-- ARGV: [1] fence ('' = unfenced), [2] count, [3] digest, [4] empty digest, [5] n,
--       [6 .. 5+n] the new items, [6+n .. 5+2n] their digests.
-- Returns {'ok'}, {'stale', refusing fence} or {'unavailable'} (the prefix does not
-- resolve).
local refused = refusal(KEYS[3], KEYS[4], ARGV[1])
if refused then return {'stale', refused} end
local count = tonumber(ARGV[2])
local resolves
if count == 0 then
  resolves = ARGV[3] == ARGV[4]
else
  resolves = redis.call('LINDEX', KEYS[2], count - 1) == ARGV[3]
end
if not resolves then return {'unavailable'} end
accept(KEYS[3], ARGV[1])
if count == 0 then
  redis.call('DEL', KEYS[1], KEYS[2])
else
  -- A dead writer may have appended past this prefix; its tail goes.
  redis.call('LTRIM', KEYS[1], 0, count - 1)
  redis.call('LTRIM', KEYS[2], 0, count - 1)
end
local n = tonumber(ARGV[5])
if n > 0 then
  push(KEYS[1], 6, 5 + n)
  push(KEYS[2], 6 + n, 5 + 2 * n)
end
return {'ok'}
