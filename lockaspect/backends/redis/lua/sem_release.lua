-- sem_release.lua: give a semaphore permit back and wake the next waiter.
--
-- KEYS[1]  the holders (see sem_acquire.lua; a value of another type is not ours)
-- KEYS[2]  the holders' fencing tokens (see sem_acquire.lua)
-- KEYS[3]  the waiter queue (see sem_acquire.lua)
-- ARGV[1]  owner token
-- ARGV[2]  the wake-up channel prefix: a waiter is woken on ARGV[2] .. ":wake:" .. <its id>
--
-- returns  1  released; the first queued waiter still listening is woken (see release.lua)
--          0  not owner: the permit had expired (or was never this token's)
-- Everything is read before the first write (lib.lua): a failing command leaves nothing.
-- include: lib.lua
local now = server_ms()
local expires, foreign = read('ZSCORE', KEYS[1], ARGV[1])
if foreign then
  return 0
end
local live = expires and tonumber(expires) > now
local waiting = live and redis.call('LLEN', KEYS[3]) > 0
-- writes from here on: the HDEL first (it fails, if the hash holds another type, before
-- anything else is written)
redis.call('HDEL', KEYS[2], ARGV[1])
if not expires then
  return 0
end
redis.call('ZREM', KEYS[1], ARGV[1])
if not live then
  return 0
end
if waiting then
  wake(KEYS[3], ARGV[2], 16, true)
end
return 1
