-- unqueue.lua: take a waiter off a lock's queue (it gave up waiting).
--
-- KEYS[1]  the lock's waiter queue (see acquire.lua)
-- ARGV[1]  waiter id
--
-- returns  the number of entries removed (0 or 1)
return redis.call('LREM', KEYS[1], 0, ARGV[1])
