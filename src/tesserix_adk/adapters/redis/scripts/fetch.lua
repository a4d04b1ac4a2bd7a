-- fetch: the items of a transcript prefix, if it still resolves.
-- KEYS: [1] items, [2] digests.
-- ARGV: [1] count, [2] digest, [3] empty digest.
-- Returns {'ok', items} or {'unavailable'}.
local count = tonumber(ARGV[1])
if count == 0 then
  if ARGV[2] == ARGV[3] then return {'ok', {}} end
  return {'unavailable'}
end
if redis.call('LINDEX', KEYS[2], count - 1) ~= ARGV[2] then return {'unavailable'} end
return {'ok', redis.call('LRANGE', KEYS[1], 0, count - 1)}
