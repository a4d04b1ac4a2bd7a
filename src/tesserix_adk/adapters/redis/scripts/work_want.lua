-- work_want: the run wants a worker (decided, wanted or submitted), not before a delay.
-- KEYS: [1] the run's work entry, [2] [3] [4] due indexes of decided, wanted and submitted
--       runs (member: run tag, score: since), [5] delayed runs (score: not before),
--       [6] every entry by since.
-- ARGV: [1] run tag, [2] tenant, [3] run id, [4] agent, [5] state, [6] delay (microseconds,
--       '0' for none), [7] '1' if a reason follows, [8] reason, [9] token of this call,
--       [10] change to the count of attempts ('' for none: the rule below).
-- Returns 1, or 0 when nothing was written: a resend of a call already applied (its token
-- is the entry's), so a lost reply does not count an attempt twice, or a count for a parked
-- or done entry.
local due = {decided = KEYS[2], wanted = KEYS[3], submitted = KEYS[4]}
if not due[ARGV[5]] then return redis.error_reply('unknown work state ' .. ARGV[5]) end
local now = now_us()
local f = redis.call('HMGET', KEYS[1], 'state', 'since', 'attempts', 'want_token')
if f[4] == ARGV[9] then return 0 end
-- A worker's count (a take, a give-back) never unparks a run or revives a finished one.
if ARGV[10] and ARGV[10] ~= '' and (f[1] == 'parked' or f[1] == 'done') then return 0 end
local since = now
if f[1] == ARGV[5] and tonumber(f[2]) then since = tonumber(f[2]) end
local delay = tonumber(ARGV[6])
local attempts = 0
if ARGV[10] and ARGV[10] ~= '' then
  -- A carrier counts its take (1), a failure after one keeps it (0), a clean stop gives
  -- it back (-1), whatever the states.
  attempts = math.max(0, (tonumber(f[3]) or 0) + tonumber(ARGV[10]))
elseif delay > 0 then
  attempts = (tonumber(f[3]) or 0) + 1
elseif f[1] == ARGV[5] then
  -- A prompt want in the same state (the runner carrying it) keeps the count of retries.
  attempts = tonumber(f[3]) or 0
end
for i = 2, 5 do redis.call('ZREM', KEYS[i], ARGV[1]) end
redis.call('HDEL', KEYS[1], 'not_before', 'reason')
redis.call('HSET', KEYS[1], 'tenant', ARGV[2], 'run_id', ARGV[3], 'agent', ARGV[4],
           'state', ARGV[5], 'since', int(since), 'attempts', int(attempts),
           'want_token', ARGV[9])
if ARGV[7] == '1' then redis.call('HSET', KEYS[1], 'reason', ARGV[8]) end
if delay > 0 then
  redis.call('HSET', KEYS[1], 'not_before', int(now + delay))
  redis.call('ZADD', KEYS[5], now + delay, ARGV[1])
else
  redis.call('ZADD', due[ARGV[5]], since, ARGV[1])
end
redis.call('ZADD', KEYS[6], since, ARGV[1])
return 1
