-- release.lua: drop one hold; at zero delete the lock and wake the waiters.
--
-- KEYS[1]  the lock hash (see acquire.lua)
-- ARGV[1]  owner token
--
-- returns  1  released: the last hold is gone, the key is deleted, and "released" is
--             published on the channel KEYS[1] .. ":released" (a channel, not a key)
--          2  still held: the token keeps at least one hold (an outer re-entrant call)
--          0  not owner: the token holds nothing (lease expired, or taken by someone else)
local holds = redis.call('HGET', KEYS[1], ARGV[1])
if not holds then
  return 0
end
if tonumber(holds) > 1 then
  redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
  return 2
end
redis.call('DEL', KEYS[1])
-- pcall: a server user without pub/sub rights still releases; its waiters poll instead.
redis.pcall('PUBLISH', KEYS[1] .. ':released', 'released')
return 1
