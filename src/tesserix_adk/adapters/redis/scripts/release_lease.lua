-- release_lease: free a run, only for the holder at that fence.
-- KEYS: [1] lease.
-- ARGV: [1] holder, [2] fence.
-- Returns 1 if released, else 0.
-- The fence counter is another key and stays; the hash stays too, holderless, its deadline
-- moved back to the release, which the next acquisition reports as the moment the previous
-- lease ended.
local current = redis.call('HMGET', KEYS[1], 'holder', 'fence', 'deadline')
if current[1] == ARGV[1] and current[2] == ARGV[2] then
  local ended = now_us()
  if current[3] and tonumber(current[3]) < ended then ended = tonumber(current[3]) end
  redis.call('HDEL', KEYS[1], 'holder', 'token', 'previous_end')
  redis.call('HSET', KEYS[1], 'deadline', int(ended))
  return 1
end
return 0
