-- rw_release.lua: give back a read or write hold of a read-write lock; wake waiters once
-- the lock may be free for someone else.
--
-- KEYS[1]  the writer (see rw_acquire.lua: owner fields; a value of another type is not ours)
-- KEYS[2]  the readers (a value of another type is not ours)
-- KEYS[3]  the readers' fencing tokens
-- KEYS[4]  the waiter queue
-- ARGV[1]  owner token
-- ARGV[2]  "read" or "write"
-- ARGV[3]  the wake-up channel prefix: a waiter is woken on ARGV[3] .. ":wake:" .. <its id>
--
-- returns  1  released; when no writer and no reader is left (or a writer left: readers may
--             all come in), up to 16 queued waiters are woken, each on its own channel
--          0  not owner: the hold had ended (lease expired) or was never this token's
-- A reader's entry in KEYS[3] (its fence and owner record) is deleted either way.
-- Everything is read before the first write (lib.lua): a failing command leaves nothing.
-- include: lib.lua
if ARGV[2] == 'write' then
  if read('HEXISTS', KEYS[1], owner_field(ARGV[1])) ~= 1 then
    return 0
  end
  -- the wake-up first: its LPOP is the first write (it fails, if the queue holds another
  -- type, before the writer is deleted)
  wake(KEYS[4], ARGV[3], 16, false)
  redis.call('DEL', KEYS[1])
  return 1
end
local now = server_ms()
local expires, foreign = read('ZSCORE', KEYS[2], ARGV[1])
if foreign then
  return 0
end
local live = expires and tonumber(expires) > now
-- the last reader out (no writer either) wakes the waiters
local last = live
  and redis.call('ZCOUNT', KEYS[2], '(' .. now, '+inf') == 1
  and redis.call('EXISTS', KEYS[1]) == 0
  and redis.call('LLEN', KEYS[4]) > 0
-- writes from here on: the HDEL first (it fails, if the hash holds another type, before
-- anything else is written)
redis.call('HDEL', KEYS[3], ARGV[1])
if not expires then
  return 0
end
redis.call('ZREM', KEYS[2], ARGV[1])
if not live then
  return 0
end
if last then
  wake(KEYS[4], ARGV[3], 16, false)
end
return 1
