-- release_claim: drop a ttl claim (or an undispatched one) held in flight by ARGV[1].
-- KEYS: [1] record, [2] the run's record set, [3] the run's records by iteration.
-- ARGV: [1] holder, [2] member (the encoded key), [3] undispatched ('1'/'0').
-- Returns 1 if dropped, else 0 (anything else is left alone).
local current = redis.call('HMGET', KEYS[1], 'status', 'holder', 'expires_at')
local releasable = current[3] or ARGV[3] == '1'
if current[1] == 'in_flight' and current[2] == ARGV[1] and releasable then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[2], ARGV[2])
  redis.call('ZREM', KEYS[3], ARGV[2])
  return 1
end
return 0
