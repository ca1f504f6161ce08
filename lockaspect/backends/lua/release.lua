-- release.lua: drop one hold; at zero delete the lock and wake the next waiter.
--
-- KEYS[1]  the lock hash (see acquire.lua)
-- KEYS[2]  the lock's waiter queue (see acquire.lua)
-- ARGV[1]  owner token
--
-- returns  1  released: the last hold is gone and the key is deleted. The first waiter of the
--             queue still listening is woken with a message on KEYS[1] .. ":wake:" .. <its
--             id> (a channel, not a key): one wake-up per release, in queue order. A waiter
--             whose process is gone (nobody receives) is skipped.
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
for _ = 1, 16 do
  local waiter = redis.call('LPOP', KEYS[2])
  if not waiter then
    break
  end
  -- pcall: a server user without pub/sub rights still releases; its waiters poll instead.
  local received = redis.pcall('PUBLISH', KEYS[1] .. ':wake:' .. waiter, 'released')
  if type(received) ~= 'number' or received > 0 then
    break
  end
end
return 1
