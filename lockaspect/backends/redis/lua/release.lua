-- release.lua: give the lock back: delete it and wake the next waiter.
--
-- KEYS[1]  the lock hash (see acquire.lua: owner fields; a value of another type is not ours)
-- KEYS[2]  the lock's waiter queue: ":waiters", or ":fair" for the fair lock (acquire.lua)
-- KEYS[3]  fair lock only: the waiters' last-seen hash (acquire.lua)
-- ARGV[1]  owner token
-- ARGV[2]  fair lock only: "fair"
-- ARGV[3]  fair lock only: ms after its last attempt that a waiter counts as gone
-- ARGV[4]  fair lock only: ms after its last attempt during which a waiter that nobody
--          receives for may still be subscribing, so it keeps its place
--
-- returns  1  released: the key is deleted (the store keeps one hold per owner: re-entries
--             are counted by the client, which releases only its last). The first waiter of the
--             queue still listening is woken with a message on KEYS[1] .. ":wake:" .. <its
--             id> (a channel, not a key): one wake-up per release, in queue order. The lock
--             pops it; the fair lock leaves it first in line (it takes itself off when it
--             acquires). A waiter that nobody receives for is skipped (popped): on the fair
--             lock only once it is gone (ARGV[3]) or, unless it polls (an id starting with
--             "p"), past its grace (ARGV[4]).
--          2  still held: never returned any more (kept in the contract for older clients)
--          0  not owner: the token holds nothing (lease expired, or taken by someone else)
-- Everything is read before the first write (lib.lua): a failing command leaves nothing.
-- include: lib.lua
local owner = owner_field(ARGV[1])
local holds = read('HGET', KEYS[1], owner)
if not holds then
  return 0
end
if ARGV[2] ~= 'fair' then
  -- the wake-up first: its LPOP is the first write (it fails, if the queue holds another
  -- type, before the lock is deleted)
  wake(KEYS[2], KEYS[1], 16, true)
  redis.call('DEL', KEYS[1])
  return 1
end
local now = server_ms()
local queue = redis.call('LRANGE', KEYS[2], 0, 15)
local seen = redis.call('HMGET', KEYS[3], '', unpack(queue))
-- writes from here on (PUBLISH writes no key)
local skipped = 0
for i, waiter in ipairs(queue) do
  local at = tonumber(seen[i + 1])
  if at and now - at <= tonumber(ARGV[3]) then
    local received = redis.pcall('PUBLISH', KEYS[1] .. ':wake:' .. waiter, 'released')
    if type(received) ~= 'number' or received > 0 then
      break
    end
    if string.sub(waiter, 1, 1) == 'p' or now - at <= tonumber(ARGV[4]) then
      break
    end
  end
  skipped = i
end
redis.call('DEL', KEYS[1])
if skipped > 0 then
  redis.call('LTRIM', KEYS[2], skipped, -1)
  hdel_all(KEYS[3], {unpack(queue, 1, skipped)})
end
return 1
