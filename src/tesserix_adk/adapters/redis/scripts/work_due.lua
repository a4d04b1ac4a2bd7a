-- work_due: up to a limit of runs a worker may take now: decided, then wanted, then
-- submitted, oldest first within each; none with a live lease by the server's TIME.
-- KEYS: [1] [2] [3] due indexes of decided, wanted and submitted runs (member: run tag,
--       score: since), [4] delayed runs (score: not before).
-- ARGV: [1] key prefix, [2] limit, [3] scan budget, [4] '1' if agents follow, [5...] agents.
-- Returns a list of entries, each {tenant, run id, agent, state, since, not before,
-- attempts, reason}.
-- Reads keys it cannot declare: each candidate's work entry and lease hash, named from its
-- tag (<prefix>{<tag>}:work and :lease); which runs are candidates is only known here. That
-- is fine on one server; Redis Cluster needs another layout (see keys.py).
-- First, delayed runs whose time has come move to their state's index (at most the budget
-- of them per call; the rest move on the next). Then each state's index is read from its
-- head, skipping runs of other agents and runs whose lease has a holder and a deadline not
-- yet passed, examining at most limit + budget entries per state, so a head full of runs
-- being carried costs at most that and a later state is still reached.
local prefix, limit, budget = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local agents = nil
if ARGV[4] == '1' then
  agents = {}
  for i = 5, #ARGV do agents[ARGV[i]] = true end
end
local function entry_key(tag) return prefix .. '{' .. tag .. '}:work' end
local function lease_key(tag) return prefix .. '{' .. tag .. '}:lease' end
local now = now_us()
local by_state = {decided = KEYS[1], wanted = KEYS[2], submitted = KEYS[3]}
local ready = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now, 'LIMIT', 0, budget)
for _, tag in ipairs(ready) do
  local f = redis.call('HMGET', entry_key(tag), 'state', 'since')
  redis.call('ZREM', KEYS[4], tag)
  if f[1] then
    -- A state no kit wrote goes where it is read, and read back as damage.
    redis.call('ZADD', by_state[f[1]] or KEYS[2], tonumber(f[2]) or 0, tag)
  end
end
local out = {}
local step = 64
for s = 1, 3 do
  local offset, examined, cap = 0, 0, limit + budget
  while #out < limit and examined < cap do
    local batch = redis.call('ZRANGE', KEYS[s], offset, offset + step - 1)
    if #batch == 0 then break end
    offset = offset + #batch
    for _, tag in ipairs(batch) do
      examined = examined + 1
      -- pcall: one run's key holding another type (a hand edit, another app) is that
      -- run's damage, skipped here, never a failure of every worker's poll.
      local f = redis.pcall('HMGET', entry_key(tag), 'tenant', 'run_id', 'agent', 'state',
                            'since', 'not_before', 'attempts', 'reason')
      if f.err then
        -- skipped: its entry cannot be read
      elseif not f[1] and not f[4] then
        -- A member whose entry is gone names nothing: drop it from the index.
        redis.call('ZREM', KEYS[s], tag)
        offset = offset - 1
      elseif agents == nil or agents[f[3]] then
        local lease = redis.pcall('HMGET', lease_key(tag), 'holder', 'deadline')
        -- A lease with a holder and a deadline that is not a number is taken as live:
        -- handing its run out could start a second carrier. So is one that cannot be read.
        local live = lease.err or
          (lease[1] and not (tonumber(lease[2]) and now >= tonumber(lease[2])))
        if not live then table.insert(out, f) end
      end
      if #out >= limit or examined >= cap then break end
    end
  end
  if #out >= limit then break end
end
return out
