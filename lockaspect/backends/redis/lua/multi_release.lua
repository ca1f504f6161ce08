-- multi_release.lua: give back every lock of a multi-key set at once (release.lua, per key).
--
-- KEYS[2i-1]  the lock hash of the i-th key (see acquire.lua: owner fields; a value of
--             another type is not ours), keys in the caller's order
-- KEYS[2i]    its waiter queue (":waiters", see acquire.lua)
-- ARGV[1]     owner token (the same for every key: multi_acquire.lua took them for it)
--
-- returns  {code_1, ..., code_n}, per key as release.lua answers for a lock:
--          1  released: the key is deleted, and the first waiter of its queue still
--             listening is woken with a message on KEYS[2i-1] .. ":wake:" .. <its id> (one
--             wake-up per release per key, in queue order; a waiter nobody receives for is
--             popped and the next one tried)
--          0  not owner: the token holds nothing there (lease expired, force-released, taken
--             by someone else); that key is left as it is, the others are still released
--          A key repeated in KEYS answers as its first occurrence (released once).
-- The fence counters are not touched (they outlive the locks, as with release.lua), and the
-- owner records go with the deleted hashes.
-- Everything is read before the first write (lib.lua): a failing command leaves nothing. Each
-- owned key's queue is read (LLEN) first, so a queue of another type fails the whole call
-- before any lock is deleted, as it fails release.lua before its DEL.
-- include: lib.lua
local n = #KEYS / 2
local owner = owner_field(ARGV[1])
local reply, waiting, first = {}, {}, {}
for i = 1, n do
  local lock = KEYS[2 * i - 1]
  if first[lock] then
    reply[i] = -first[lock]
  elseif read('HGET', lock, owner) then
    reply[i] = 1
    waiting[i] = redis.call('LLEN', KEYS[2 * i]) > 0
    first[lock] = i
  else
    reply[i] = 0
    first[lock] = i
  end
end
-- writes from here on
for i = 1, n do
  if reply[i] == 1 then
    if waiting[i] then
      wake(KEYS[2 * i], KEYS[2 * i - 1], 16, true)
    end
    redis.call('DEL', KEYS[2 * i - 1])
  end
end
for i = 1, n do
  if reply[i] < 0 then
    reply[i] = reply[-reply[i]]
  end
end
return reply
