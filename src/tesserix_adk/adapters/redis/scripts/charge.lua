-- charge: add a model call's cost and usage to a run's ledger.
-- KEYS: [1] ledger, [2] seen fence, [3] lease fence.
-- ARGV: [1] fence ('' = unfenced), [2] micros, [3] input tokens, [4] output tokens,
--       [5] token of this call.
-- Returns {'ok'} or {'stale', refusing fence}.
-- A charge is the one write that is not idempotent; its token makes redis-py's resend of a
-- command whose reply was lost count once. (One writer charges a run at a time, so the last
-- token is enough.)
if redis.call('HGET', KEYS[1], 'last_charge') == ARGV[5] then return {'ok'} end
local refused = refusal(KEYS[2], KEYS[3], ARGV[1])
if refused then return {'stale', refused} end
accept(KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[1], 'micros', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'input_tokens', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'output_tokens', ARGV[4])
redis.call('HSET', KEYS[1], 'last_charge', ARGV[5])
return {'ok'}
