-- common: the prelude the loader prepends to every script (redis/scripts.py).
-- KEYS: none of its own; each function takes the keys it reads as arguments.
-- ARGV: none of its own; push(key, first, last) pushes ARGV[first..last] of the script.
-- refusal() returns the fence that refuses a write (the highest seen by this store, or the
-- run's current lease fence), else false.
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function int(x)
  return string.format('%.0f', x)
end
local function refusal(seen_key, lease_key, fence)
  local seen = redis.call('GET', seen_key)
  local leased = redis.call('GET', lease_key)
  if fence == '' then
    if seen then return seen end
    return leased
  end
  local f = tonumber(fence)
  if seen and tonumber(seen) > f then return seen end
  if leased and tonumber(leased) > f then return leased end
  return false
end
-- A record that is there but cannot be what a kit wrote (not a hash, no known status, an
-- expiry that is not a number): never taken for absent, never overwritten.
local function damaged(key)
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'none' then return false end
  if kind ~= 'hash' then return true end
  local fields = redis.call('HMGET', key, 'status', 'expires_at')
  local status = fields[1]
  if status ~= 'in_flight' and status ~= 'completed' and status ~= 'never_ran' then
    return true
  end
  return fields[2] and not tonumber(fields[2])
end
local function accept(seen_key, fence)
  if fence == '' then return end
  local seen = redis.call('GET', seen_key)
  if (not seen) or tonumber(seen) < tonumber(fence) then
    redis.call('SET', seen_key, fence)
  end
end
local function push(key, first, last)
  for i = first, last, 1000 do
    redis.call('RPUSH', key, unpack(ARGV, i, math.min(i + 999, last)))
  end
end
-- The transcript's lists (items, digests) end in the prefix of `count` items whose chained
-- digest is `digest` (`empty`: the digest of no items).
local function resolves(digests_key, count, digest, empty)
  if count == 0 then return digest == empty end
  -- LINDEX counts a negative index from the end: no prefix has a negative count.
  if count < 0 then return false end
  return redis.call('LINDEX', digests_key, count - 1) == digest
end
-- The first of `keys` that holds another type than its `kinds` (or nothing), else false:
-- checked before a script writes anything, since Redis keeps what a script wrote before
-- a command of it failed.
local function mistyped(keys, kinds)
  for i = 1, #keys do
    local kind = redis.call('TYPE', keys[i])['ok']
    if kind ~= 'none' and kind ~= kinds[i] then return keys[i] end
  end
  return false
end
-- Keep the first `count` items of the transcript (a dead writer's tail goes), then push
-- ARGV[first .. first+n-1] as items and the next n ARGV as their digests.
local function append_after(items_key, digests_key, count, first, n)
  if count == 0 then
    redis.call('DEL', items_key, digests_key)
  else
    redis.call('LTRIM', items_key, 0, count - 1)
    redis.call('LTRIM', digests_key, 0, count - 1)
  end
  if n > 0 then
    push(items_key, first, first + n - 1)
    push(digests_key, first + n, first + 2 * n - 1)
  end
end
-- Write the frontier and the same payload as step `step`, pruning the steps to keep_last.
-- keys: frontier, steps, step fences, step index.
local function put_frontier(frontier, steps, step_fences, step_index, fence, step, payload,
                            keep_last)
  redis.call('HSET', frontier, 'payload', payload, 'step', step, 'fence', fence)
  redis.call('HSET', steps, step, payload)
  redis.call('HSET', step_fences, step, fence)
  redis.call('ZADD', step_index, step, step)
  if keep_last ~= '' then
    local extra = redis.call('ZCARD', step_index) - tonumber(keep_last)
    while extra > 0 do
      local old = redis.call('ZRANGE', step_index, 0, math.min(extra, 1000) - 1)
      redis.call('ZREM', step_index, unpack(old))
      redis.call('HDEL', steps, unpack(old))
      redis.call('HDEL', step_fences, unpack(old))
      extra = extra - #old
    end
  end
end
