-- work_wake: a parked run woken as it was read (of the agent, with the attempts counted and
-- parked for the reason): wanted now, one more attempt counted, no reason, in one step, so
-- the count goes on. An entry changed since it was read is left as it is.
-- KEYS: [1] the run's work entry, [2] [3] [4] due indexes of decided, wanted and submitted
--       runs, [5] delayed runs, [6] every entry by since.
-- ARGV: [1] run tag, [2] agent, [3] attempts as read, [4] '1' if a reason follows,
--       [5] reason.
-- Returns 1 when woken, 0 when nothing was written (sent again after it was applied, the
-- entry is no longer parked, so nothing is counted twice).
local f = redis.call('HMGET', KEYS[1], 'state', 'agent', 'attempts', 'reason')
if f[1] ~= 'parked' or f[2] ~= ARGV[2] or tonumber(f[3]) ~= tonumber(ARGV[3]) then
  return 0
end
if ARGV[4] == '1' then
  if f[4] ~= ARGV[5] then return 0 end
elseif f[4] then
  return 0
end
local now = now_us()
for i = 2, 5 do redis.call('ZREM', KEYS[i], ARGV[1]) end
redis.call('HDEL', KEYS[1], 'not_before', 'reason')
redis.call('HSET', KEYS[1], 'state', 'wanted', 'since', int(now),
           'attempts', int(tonumber(f[3]) + 1))
redis.call('ZADD', KEYS[3], now, ARGV[1])
redis.call('ZADD', KEYS[6], now, ARGV[1])
return 1
