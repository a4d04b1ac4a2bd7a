-- put: write a run's frontier, and the same payload as step ARGV[2], pruning to keep_last.
-- KEYS: [1] frontier, [2] steps, [3] step fences, [4] step index, [5] seen fence,
--       [6] lease fence.
-- ARGV: [1] fence ('' = unfenced), [2] step, [3] payload, [4] keep_last ('' = keep every
--       step).
-- Returns {'ok'} or {'stale', refusing fence}.
local refused = refusal(KEYS[5], KEYS[6], ARGV[1])
if refused then return {'stale', refused} end
accept(KEYS[5], ARGV[1])
redis.call('HSET', KEYS[1], 'payload', ARGV[3], 'step', ARGV[2], 'fence', ARGV[1])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[2])
if ARGV[4] ~= '' then
  local extra = redis.call('ZCARD', KEYS[4]) - tonumber(ARGV[4])
  while extra > 0 do
    local old = redis.call('ZRANGE', KEYS[4], 0, math.min(extra, 1000) - 1)
    redis.call('ZREM', KEYS[4], unpack(old))
    redis.call('HDEL', KEYS[2], unpack(old))
    redis.call('HDEL', KEYS[3], unpack(old))
    extra = extra - #old
  end
end
return {'ok'}
