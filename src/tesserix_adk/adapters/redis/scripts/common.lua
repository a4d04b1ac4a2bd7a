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
