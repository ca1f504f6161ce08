-- sem_release.lua: give a semaphore permit back and wake the next waiter.
--
-- KEYS[1]  the holders (see sem_acquire.lua)
-- KEYS[2]  the holders' fencing tokens (see sem_acquire.lua)
-- KEYS[3]  the waiter queue (see sem_acquire.lua)
-- ARGV[1]  owner token
-- ARGV[2]  the wake-up channel prefix: a waiter is woken on ARGV[2] .. ":wake:" .. <its id>
--
-- returns  1  released; the first queued waiter still listening is woken (see release.lua)
--          0  not owner: the permit had expired (or was never this token's)
-- include: lib.lua
local now = server_ms()
local expires = redis.call('ZSCORE', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if not expires or tonumber(expires) <= now then
  return 0
end
wake(KEYS[3], ARGV[2], 16, true)
return 1
