-- current: the lease live by the server's clock.
-- KEYS: [1] lease.
-- ARGV: none.
-- Returns {holder, fence, deadline}, or {} when no lease is live.
local now = now_us()
local current = redis.call('HMGET', KEYS[1], 'holder', 'fence', 'deadline')
if current[1] and now < tonumber(current[3]) then
  return {current[1], current[2], current[3]}
end
return {}
