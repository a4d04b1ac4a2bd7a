-- request: record a pending approval request.
-- KEYS: [1] request, [2] seen fence, [3] lease fence.
-- ARGV: [1] fence ('' = unfenced), [2...] the request's fields as name/value pairs.
-- Returns {'ok', the request's fields} or {'stale', refusing fence}. A request already
-- there (another attempt of the run asked under the same id meanwhile, and a person may
-- have decided it) is returned as it is, never made pending again.
local refused = refusal(KEYS[2], KEYS[3], ARGV[1])
if refused then return {'stale', refused} end
accept(KEYS[2], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 'status', 'pending', 'requested_at', int(now_us()), unpack(ARGV, 2))
end
return {'ok', redis.call('HGETALL', KEYS[1])}
