-- work_done: the run wants no worker now; its entry (and submission) stays, out of the due
-- index. A no-op for a run the index does not hold.
-- KEYS: [1] the run's work entry, [2] [3] [4] due indexes of decided, wanted and submitted
--       runs, [5] delayed runs, [6] every entry by since.
-- ARGV: [1] run tag.
-- Returns 1 if the run was known, else 0.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local now = now_us()
for i = 2, 5 do redis.call('ZREM', KEYS[i], ARGV[1]) end
redis.call('HDEL', KEYS[1], 'not_before', 'reason')
redis.call('HSET', KEYS[1], 'state', 'done', 'since', int(now), 'attempts', '0')
redis.call('ZADD', KEYS[6], now, ARGV[1])
return 1
