-- rw_release.lua: give back a read or write hold of a read-write lock; wake waiters once
-- the lock may be free for someone else.
--
-- KEYS[1]  the writer (see rw_acquire.lua)
-- KEYS[2]  the readers
-- KEYS[3]  the readers' fencing tokens
-- KEYS[4]  the waiter queue
-- ARGV[1]  owner token
-- ARGV[2]  "read" or "write"
-- ARGV[3]  the wake-up channel prefix: a waiter is woken on ARGV[3] .. ":wake:" .. <its id>
--
-- returns  1  released; when no writer and no reader is left (or a writer left: readers may
--             all come in), up to 16 queued waiters are woken, each on its own channel
--          0  not owner: the hold had ended (lease expired) or was never this token's
-- include: lib.lua
local now = server_ms()
if ARGV[2] == 'write' then
  if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then
    return 0
  end
  redis.call('DEL', KEYS[1])
else
  local expires = redis.call('ZSCORE', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[3], ARGV[1])
  if not expires or tonumber(expires) <= now then
    return 0
  end
  if redis.call('ZCOUNT', KEYS[2], '(' .. now, '+inf') > 0 or redis.call('EXISTS', KEYS[1]) == 1 then
    return 1
  end
end
wake(KEYS[4], ARGV[3], 16, false)
return 1
