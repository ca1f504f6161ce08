-- acquire.lua: take a reentrant, fenced lock, or report how long the holder keeps it.
--
-- KEYS[1]  the lock: a hash {<owner token> = hold count, "fence" = fencing token}
-- KEYS[2]  the lock's fence counter (never expires: fencing tokens must keep growing)
-- ARGV[1]  owner token (32 hex characters, never equal to "fence")
-- ARGV[2]  lease in milliseconds (ignored for re-entry: re-entry never changes the lease)
-- ARGV[3]  "1" for re-entry: add a hold only if ARGV[1] still owns the lock, never take it
--
-- returns  {1, fence, holds}  ours. First acquisition: holds = 1, fence = INCR of KEYS[2].
--                             Re-entry: holds after the increment. A first acquisition
--                             repeated with the same token (a retried request) is answered
--                             again without adding a hold.
--          {0, pttl}          not ours: busy (pttl = holder's remaining lease in ms, -1 if
--                             the key has no expiry) or, for re-entry, lost (pttl = -2 when
--                             the key is gone)
local holds = redis.call('HGET', KEYS[1], ARGV[1])
if holds then
  if ARGV[3] == '1' then
    holds = redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
  end
  return {1, tonumber(redis.call('HGET', KEYS[1], 'fence')), tonumber(holds)}
end
local pttl = redis.call('PTTL', KEYS[1])
if ARGV[3] == '1' or pttl ~= -2 then
  return {0, pttl}
end
local fence = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], ARGV[1], 1, 'fence', fence)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, fence, 1}
