-- claim: claim an idempotency key for a holder, or return the record that stands.
-- KEYS: [1] record, [2] the run's record set, [3] seen fence, [4] lease fence,
--       [5] the run's records by iteration.
-- ARGV: [1] holder, [2] fence ('' = none), [3] ttl (microseconds, '' = none),
--       [4] takeover ('1'/'0'), [5] fenced ('1'/'0'), [6] member (the encoded key),
--       [7] the claim's iteration ('-inf' = none),
--       [8...] the fresh record's other fields as name/value pairs.
-- Returns {'ok', the record's fields}, {'stale', refusing fence} or {'damaged'}.
local holder, fence, ttl = ARGV[1], ARGV[2], ARGV[3]
if ARGV[5] == '1' then
  local refused = refusal(KEYS[3], KEYS[4], fence)
  if refused then return {'stale', refused} end
else
  fence = ''
end
if damaged(KEYS[1]) then return {'damaged'} end
local now = now_us()
local expires = ''
if ttl ~= '' then expires = int(now + tonumber(ttl)) end
local current = redis.call('HMGET', KEYS[1], 'status', 'holder', 'expires_at')
local status = current[1]
if status == 'in_flight' and current[3] and now >= tonumber(current[3]) then
  status = false
end
local function set_or_drop(field, value)
  if value == '' then
    redis.call('HDEL', KEYS[1], field)
  else
    redis.call('HSET', KEYS[1], field, value)
  end
end
if (not status) or status == 'never_ran' then
  -- Who said it never ran stays on the new claim: that word let it go out again.
  local said = false
  if status == 'never_ran' then said = redis.call('HGET', KEYS[1], 'by') end
  -- The record is rewritten in place, never deleted first: in a slot that is migrating,
  -- Redis refuses a write to a key the script just deleted, and keeps the delete.
  local fresh = {status = true, holder = true, since = true}
  for i = 8, #ARGV, 2 do fresh[ARGV[i]] = true end
  for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
    if not fresh[name] then redis.call('HDEL', KEYS[1], name) end
  end
  redis.call('HSET', KEYS[1], 'status', 'in_flight', 'holder', holder, 'since', int(now),
             unpack(ARGV, 8))
  if said then redis.call('HSET', KEYS[1], 'never_ran_by', said) end
  set_or_drop('fence', fence)
  set_or_drop('expires_at', expires)
  redis.call('SADD', KEYS[2], ARGV[6])
  redis.call('ZADD', KEYS[5], ARGV[7], ARGV[6])
elseif status == 'in_flight' and current[2] == holder then
  if fence ~= '' then redis.call('HSET', KEYS[1], 'fence', fence) end
  if expires ~= '' then redis.call('HSET', KEYS[1], 'expires_at', expires) end
elseif status == 'in_flight' and ARGV[4] == '1' then
  -- The call stays its first run's; the run whose holder took it over is named beside.
  local claimant = {}
  for i = 8, #ARGV, 2 do claimant[ARGV[i]] = ARGV[i + 1] end
  local other = claimant.run_id ~= redis.call('HGET', KEYS[1], 'run_id')
  redis.call('HSET', KEYS[1], 'holder', holder, 'since', int(now))
  set_or_drop('holder_run', other and claimant.run_id or '')
  set_or_drop('holder_iteration', other and claimant.iteration or '')
  set_or_drop('holder_call_id', other and claimant.call_id or '')
  set_or_drop('fence', fence)
  set_or_drop('expires_at', expires)
end
if ARGV[5] == '1' then accept(KEYS[3], fence) end
return {'ok', redis.call('HGETALL', KEYS[1])}
