-- work_submit: record a run as submitted, unless the work index knows it in any state.
-- KEYS: [1] the run's work entry, [2] due index of submitted runs, [3] every entry by since.
-- ARGV: [1] run tag (the index member), [2] tenant, [3] run id, [4] agent, [5] input,
--       [6] token of this call.
-- Returns 1 if recorded, 0 if the run was known. A resend of the call that recorded it (its
-- reply lost) finds its own token and answers 1 again.
local known = redis.call('HGET', KEYS[1], 'submit_token')
if known then
  if known == ARGV[6] then return 1 end
  return 0
end
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local now = now_us()
redis.call('HSET', KEYS[1], 'tenant', ARGV[2], 'run_id', ARGV[3], 'agent', ARGV[4],
           'state', 'submitted', 'since', int(now), 'attempts', '0', 'input', ARGV[5],
           'submit_token', ARGV[6])
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('ZADD', KEYS[3], now, ARGV[1])
return 1
