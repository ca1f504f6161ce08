-- unqueue.lua: take a waiter off a lock's queue (it gave up waiting).
--
-- KEYS[1]  the lock's waiter queue (see acquire.lua, sem_acquire.lua, rw_acquire.lua)
-- KEYS[2]  optional: where the waiter is also registered: the fair lock's last-seen hash
--          (ARGV[2] "hash"), or a read-write lock's waiting writers (ARGV[2] "zset")
-- ARGV[1]  waiter id
-- ARGV[2]  with KEYS[2]: "hash" or "zset"
--
-- returns  the number of queue entries removed (0 or 1)
if KEYS[2] then
  if ARGV[2] == 'zset' then
    redis.call('ZREM', KEYS[2], ARGV[1])
  else
    redis.call('HDEL', KEYS[2], ARGV[1])
  end
end
return redis.call('LREM', KEYS[1], 0, ARGV[1])
