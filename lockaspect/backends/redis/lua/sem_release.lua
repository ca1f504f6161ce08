-- sem_release.lua: give a semaphore hold back (all its permits) and wake waiters.
--
-- KEYS[1]  the holders (see sem_acquire.lua; a value of another type is not ours)
-- KEYS[2]  the holders' fencing tokens and owner records (see sem_acquire.lua)
-- KEYS[3]  the waiter queue (see sem_acquire.lua)
-- KEYS[4]  the holders' weights (see sem_acquire.lua: only holders of more than one permit)
-- ARGV[1]  owner token
-- ARGV[2]  the wake-up channel prefix: a waiter is woken on ARGV[2] .. ":wake:" .. <its id>
--
-- returns  1  released; a hold of one permit wakes the first queued waiter still listening
--             (see release.lua), a hold of w permits up to min(16, w) queued waiters (each
--             may want one)
--          0  not owner: the hold had expired (or was never this token's)
-- The token's entries in KEYS[2] and KEYS[4] are deleted either way.
-- Everything is read before the first write (lib.lua): a failing command leaves nothing.
-- include: lib.lua
local now = server_ms()
local expires, foreign = read('ZSCORE', KEYS[1], ARGV[1])
if foreign then
  return 0
end
local live = expires and tonumber(expires) > now
local waiting = live and redis.call('LLEN', KEYS[3]) > 0
-- read before the writes below: fails if the hash holds another type
local weight = tonumber(redis.call('HGET', KEYS[4], ARGV[1])) or 1
-- writes from here on: the HDEL of the fences first (it fails, if the hash holds another
-- type, before anything else is written)
redis.call('HDEL', KEYS[2], ARGV[1])
if weight > 1 then
  redis.call('HDEL', KEYS[4], ARGV[1])
end
if not expires then
  return 0
end
redis.call('ZREM', KEYS[1], ARGV[1])
if not live then
  return 0
end
if waiting then
  if weight > 1 then
    wake(KEYS[3], ARGV[2], math.min(16, weight), false)
  else
    wake(KEYS[3], ARGV[2], 16, true)
  end
end
return 1
