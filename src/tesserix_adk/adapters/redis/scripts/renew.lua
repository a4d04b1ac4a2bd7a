-- renew: extend a live lease held by ARGV[1] at fence ARGV[2].
-- KEYS: [1] lease.
-- ARGV: [1] holder, [2] fence, [3] ttl (microseconds).
-- Returns {'ok', deadline} or {'lost'}.
local now = now_us()
local current = redis.call('HMGET', KEYS[1], 'holder', 'fence', 'deadline')
if (not current[1]) or current[1] ~= ARGV[1] or current[2] ~= ARGV[2]
    or now >= tonumber(current[3]) then
  return {'lost'}
end
local deadline = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'deadline', int(deadline))
return {'ok', int(deadline)}
