-- decide: decide a pending approval request; the same decision again is a no-op.
-- KEYS: [1] request.
-- ARGV: [1] status, [2] by, [3] has note ('1'/'0'), [4] note.
-- Returns {'ok', fields}, {'decided', fields} (decided the other way) or {'absent'}.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {'absent'} end
if status == ARGV[1] then return {'ok', redis.call('HGETALL', KEYS[1])} end
if status ~= 'pending' then
  return {'decided', redis.call('HGETALL', KEYS[1])}
end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'by', ARGV[2], 'decided_at', int(now_us()))
if ARGV[3] == '1' then redis.call('HSET', KEYS[1], 'note', ARGV[4]) end
return {'ok', redis.call('HGETALL', KEYS[1])}
