-- release.lua: drop one hold; at zero delete the lock and wake the next waiter.
--
-- KEYS[1]  the lock hash (see acquire.lua)
-- KEYS[2]  the lock's waiter queue: ":waiters", or ":fair" for the fair lock (acquire.lua)
-- KEYS[3]  fair lock only: the waiters' last-seen hash (acquire.lua)
-- ARGV[1]  owner token
-- ARGV[2]  fair lock only: "fair"
-- ARGV[3]  fair lock only: ms after its last attempt that a waiter counts as gone
-- ARGV[4]  fair lock only: ms after its last attempt during which a waiter that nobody
--          receives for may still be subscribing, so it keeps its place
--
-- returns  1  released: the last hold is gone and the key is deleted. The first waiter of the
--             queue still listening is woken with a message on KEYS[1] .. ":wake:" .. <its
--             id> (a channel, not a key): one wake-up per release, in queue order. The lock
--             pops it; the fair lock leaves it first in line (it takes itself off when it
--             acquires). A waiter that nobody receives for is skipped (popped): on the fair
--             lock only once it is gone (ARGV[3]) or, unless it polls (an id starting with
--             "p"), past its grace (ARGV[4]).
--          2  still held: the token keeps at least one hold (an outer re-entrant call)
--          0  not owner: the token holds nothing (lease expired, or taken by someone else)
-- include: lib.lua
local holds = redis.call('HGET', KEYS[1], ARGV[1])
if not holds then
  return 0
end
if tonumber(holds) > 1 then
  redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
  return 2
end
redis.call('DEL', KEYS[1])
if ARGV[2] == 'fair' then
  local now = server_ms()
  for _ = 1, 16 do
    local waiter = redis.call('LINDEX', KEYS[2], 0)
    if not waiter then
      break
    end
    local seen = tonumber(redis.call('HGET', KEYS[3], waiter))
    if seen and now - seen <= tonumber(ARGV[3]) then
      local received = redis.pcall('PUBLISH', KEYS[1] .. ':wake:' .. waiter, 'released')
      if type(received) ~= 'number' or received > 0 then
        break
      end
      if string.sub(waiter, 1, 1) == 'p' or now - seen <= tonumber(ARGV[4]) then
        break
      end
    end
    redis.call('LPOP', KEYS[2])
    redis.call('HDEL', KEYS[3], waiter)
  end
  return 1
end
wake(KEYS[2], KEYS[1], 16, true)
return 1
