-- resolve: an operator settles an in-flight call: its outcome, or that it never ran.
-- KEYS: [1] record.
-- ARGV: [1] never_ran ('1'/'0'), [2] outcome, [3] by, [4] holder, [5] whether the record
--       must be in flight under that holder ('1'/'0': whoever holds it).
-- Returns {'ok', the record's fields}, {'absent'}, {'settled', status},
-- {'held', holder} (in flight under another holder than ARGV[4]) or {'damaged'}.
if damaged(KEYS[1]) then return {'damaged'} end
local now = now_us()
local current = redis.call('HMGET', KEYS[1], 'status', 'expires_at', 'holder')
local status = current[1]
if status == 'in_flight' and current[2] and now >= tonumber(current[2]) then
  status = false
end
if not status then return {'absent'} end
if status ~= 'in_flight' then return {'settled', status} end
if ARGV[5] == '1' and current[3] ~= ARGV[4] then return {'held', current[3]} end
if ARGV[1] == '1' then
  redis.call('HSET', KEYS[1], 'status', 'never_ran', 'by', ARGV[3])
else
  redis.call('HSET', KEYS[1], 'status', 'completed', 'outcome', ARGV[2], 'by', ARGV[3],
             'completed_at', int(now))
end
redis.call('HDEL', KEYS[1], 'expires_at')
return {'ok', redis.call('HGETALL', KEYS[1])}
