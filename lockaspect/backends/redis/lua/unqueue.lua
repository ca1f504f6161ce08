-- unqueue.lua: take a waiter off a lock's queue (it gave up waiting).
--
-- KEYS[1]  the lock's waiter queue (see acquire.lua, sem_acquire.lua, rw_acquire.lua)
-- KEYS[2]  optional: where the waiter is also registered: the fair lock's last-seen hash
--          (ARGV[2] "hash"), or a read-write lock's waiting writers (ARGV[2] "zset")
-- KEYS[3]  with "zset": the read-write lock's writer hash; with "hash", optional: the fair
--          lock's registered leases (acquire.lua's KEYS[5])
-- ARGV[1]  waiter id
-- ARGV[2]  with KEYS[2]: "hash" or "zset"
-- ARGV[3]  with "zset": the wake-up channel prefix (see rw_release.lua)
--
-- returns  the number of queue entries removed (0 or 1). When the last waiting writer of a
--          read-write lock leaves while no writer holds it, the readers it kept out are woken.
-- Everything is read before the first write (lib.lua): a failing command leaves nothing.
-- include: lib.lua
local last = false
if KEYS[2] then
  if ARGV[2] == 'zset' then
    last = redis.call('ZSCORE', KEYS[2], ARGV[1]) ~= false and redis.call('ZCARD', KEYS[2]) == 1
      and redis.call('EXISTS', KEYS[3]) == 0
  else
    redis.call('HEXISTS', KEYS[2], ARGV[1]) -- read before the HDEL below: fails on another type
    if KEYS[3] then
      redis.call('HEXISTS', KEYS[3], ARGV[1])
    end
  end
end
-- writes from here on: the LREM first (it fails, if the queue holds another type, before
-- anything else is written)
local removed = redis.call('LREM', KEYS[1], 0, ARGV[1])
if KEYS[2] then
  if ARGV[2] == 'zset' then
    redis.call('ZREM', KEYS[2], ARGV[1])
    if last then
      wake(KEYS[1], ARGV[3], 16, false)
    end
  else
    redis.call('HDEL', KEYS[2], ARGV[1])
    if KEYS[3] then
      redis.call('HDEL', KEYS[3], ARGV[1])
    end
  end
end
return removed
