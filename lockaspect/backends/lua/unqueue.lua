-- unqueue.lua: take a waiter off a lock's queue (it gave up waiting).
--
-- KEYS[1]  the lock's waiter queue (see acquire.lua)
-- KEYS[2]  optional, fair lock: the waiters' last-seen hash (see acquire.lua)
-- ARGV[1]  waiter id
--
-- returns  the number of entries removed (0 or 1)
if KEYS[2] then
  redis.call('HDEL', KEYS[2], ARGV[1])
end
return redis.call('LREM', KEYS[1], 0, ARGV[1])
