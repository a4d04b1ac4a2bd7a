-- work_park: the run must not be carried on until an operator acts; out of the due index.
-- KEYS: [1] the run's work entry, [2] [3] [4] due indexes of decided, wanted and submitted
--       runs, [5] delayed runs, [6] every entry by since.
-- ARGV: [1] run tag, [2] tenant, [3] run id, [4] agent, [5] reason.
-- Returns 1. Its attempts are kept; running it twice parks it once.
local now = now_us()
for i = 2, 5 do redis.call('ZREM', KEYS[i], ARGV[1]) end
local attempts = redis.call('HGET', KEYS[1], 'attempts') or '0'
redis.call('HDEL', KEYS[1], 'not_before')
redis.call('HSET', KEYS[1], 'tenant', ARGV[2], 'run_id', ARGV[3], 'agent', ARGV[4],
           'state', 'parked', 'since', int(now), 'attempts', attempts, 'reason', ARGV[5])
redis.call('ZADD', KEYS[6], now, ARGV[1])
return 1
