-- work_items: the entries of a tenant (or of all) in a state (or any but done), oldest
-- first: an operator's listing, which reads every entry of the index.
-- KEYS: [1] every entry by since.
-- ARGV: [1] key prefix, [2] tenant's tag part followed by ':' ('' for every tenant),
--       [3] state ('' for any but done).
-- Returns a list of entries, each {tenant, run id, agent, state, since, not before,
-- attempts, reason}, or {tag, why} for an entry whose key holds another type or that
-- lacks the fields naming it.
-- Reads each entry's hash (<prefix>{<tag>}:work), named from its tag; see work_due.lua.
local prefix, tenant, state = ARGV[1], ARGV[2], ARGV[3]
local out = {}
for _, tag in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if tenant == '' or string.sub(tag, 1, #tenant) == tenant then
    -- pcall: one run's key holding another type is that run's damage, named, never a
    -- failure of the whole listing.
    local key = prefix .. '{' .. tag .. '}:work'
    local f = redis.pcall('HMGET', key, 'tenant', 'run_id', 'agent', 'state', 'since',
                          'not_before', 'attempts', 'reason')
    if f.err then
      table.insert(out, {tag, f.err})
    elseif redis.call('EXISTS', key) == 0 then
      -- A member whose entry is gone names nothing (work_due.lua drops it too); one that
      -- lost some fields is damage, read back and named.
    elseif not f[1] or not f[2] or not f[4] then
      table.insert(out, {tag, 'it lacks its tenant, run id or state'})
    elseif (state == '' and f[4] ~= 'done') or f[4] == state then
      table.insert(out, f)
    end
  end
end
return out
