-- acquire: take a run's lease, raising its fence, unless another holder's is live.
-- KEYS: [1] lease, [2] lease fence (the acquisition counter).
-- ARGV: [1] holder, [2] ttl (microseconds), [3] token of this call.
-- Returns {'ok', fence, deadline, previous end ('' if none)} or {'held', holder}.
-- redis-py sends a command again when its reply was lost; the token tells that resend (which
-- must get the lease it already took) from a second acquisition (which must be refused).
local now = now_us()
local current = redis.call('HMGET', KEYS[1], 'holder', 'deadline', 'fence', 'token',
                            'previous_end')
if current[1] and now < tonumber(current[2]) then
  if current[4] == ARGV[3] then return {'ok', current[3], current[2], current[5] or ''} end
  return {'held', current[1]}
end
-- Never below the fence the lease itself last named: a counter the server lost (evicted,
-- deleted) would otherwise hand a fence out twice, and the old holder's writes pass. Only a
-- whole number a kit could have written counts: anything else in that field (damage) is
-- left out, never copied into the counter, which INCR could then no longer raise.
local named = current[3]
if named and string.match(named, '^%d+$') and #named <= 15 then
  local counter = redis.call('GET', KEYS[2])
  if not (counter and string.match(counter, '^%d+$') and tonumber(counter) >= tonumber(named)) then
    redis.call('SET', KEYS[2], named)
  end
end
local fence = redis.call('INCR', KEYS[2])
local deadline = now + tonumber(ARGV[2])
-- A lapsed lease ended at its deadline, a released one when it was released (its deadline
-- field then holds that moment); '' when no lease ended before.
local previous_end = current[2] or ''
redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'fence', int(fence), 'deadline', int(deadline),
           'token', ARGV[3], 'previous_end', previous_end)
return {'ok', int(fence), int(deadline), previous_end}
