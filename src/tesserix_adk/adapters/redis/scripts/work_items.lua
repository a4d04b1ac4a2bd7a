-- work_items: the entries of a tenant (or of all) in a state (or any but done), oldest
-- first: an operator's listing, which reads every entry of the index.
-- KEYS: [1] every entry by since.
-- ARGV: [1] key prefix, [2] tenant's tag part followed by ':' ('' for every tenant),
--       [3] state ('' for any but done).
-- Returns a list of entries, each {tenant, run id, agent, state, since, not before,
-- attempts, reason}, or {tag, error} for an entry whose key holds another type.
-- Reads each entry's hash (<prefix>{<tag>}:work), named from its tag; see work_due.lua.
local prefix, tenant, state = ARGV[1], ARGV[2], ARGV[3]
local out = {}
for _, tag in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if tenant == '' or string.sub(tag, 1, #tenant) == tenant then
    -- pcall: one run's key holding another type is that run's damage, named, never a
    -- failure of the whole listing.
    local f = redis.pcall('HMGET', prefix .. '{' .. tag .. '}:work', 'tenant', 'run_id',
                          'agent', 'state', 'since', 'not_before', 'attempts', 'reason')
    if f.err then
      table.insert(out, {tag, f.err})
    elseif not f[1] and not f[2] and not f[4] then
      -- A member whose entry is gone names nothing (work_due.lua drops it too).
    elseif (state == '' and f[4] ~= 'done') or f[4] == state then
      table.insert(out, f)
    end
  end
end
return out
