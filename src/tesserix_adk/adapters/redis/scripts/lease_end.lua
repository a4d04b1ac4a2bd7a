-- lease_end: how long ago a run's last lease ended.
-- KEYS: [1] lease.
-- ARGV: none.
-- Returns microseconds since a lapsed or released lease ended; '' while live or if none.
local current = redis.call('HMGET', KEYS[1], 'holder', 'deadline')
local now = now_us()
if current[2] and ((not current[1]) or now >= tonumber(current[2])) then
  return int(math.max(0, now - tonumber(current[2])))
end
return ''
