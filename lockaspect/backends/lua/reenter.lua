-- reenter.lua: add a hold for an owner that still holds the lock; never take a free lock.
--
-- KEYS[1]  the lock hash (see acquire.lua)
-- ARGV[1]  owner token
--
-- returns  holds >= 2   the owner's hold count after the increment (the lease is unchanged)
--          0            the token holds nothing: the lease is gone or someone else has it
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then
  return 0
end
return redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
