-- seal: raise the store's highest-seen fence for a run without writing data.
-- KEYS: [1] the store's seen fence, [2] the run's lease fence.
-- ARGV: [1] fence.
-- Returns {'ok'} or {'stale', refusing fence}.
local refused = refusal(KEYS[1], KEYS[2], ARGV[1])
if refused then return {'stale', refused} end
accept(KEYS[1], ARGV[1])
return {'ok'}
