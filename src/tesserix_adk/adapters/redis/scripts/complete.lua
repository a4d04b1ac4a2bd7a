-- complete: record the outcome of a claim held in flight by ARGV[2] (not fenced).
-- KEYS: [1] record.
-- ARGV: [1] outcome, [2] holder.
-- Returns {'ok', the record's fields}, {'absent'}, {'refused', status, holder} or
-- {'damaged'}.
if damaged(KEYS[1]) then return {'damaged'} end
local now = now_us()
local current = redis.call('HMGET', KEYS[1], 'status', 'holder', 'expires_at', 'by')
local status = current[1]
if status == 'in_flight' and current[3] and now >= tonumber(current[3]) then
  status = false
end
if not status then return {'absent'} end
if status == 'completed' and current[2] == ARGV[2] and not current[4] then
  return {'ok', redis.call('HGETALL', KEYS[1])}
end
if status ~= 'in_flight' or current[2] ~= ARGV[2] then
  return {'refused', status, current[2]}
end
redis.call('HSET', KEYS[1], 'status', 'completed', 'outcome', ARGV[1], 'completed_at', int(now))
redis.call('HDEL', KEYS[1], 'expires_at')
return {'ok', redis.call('HGETALL', KEYS[1])}
