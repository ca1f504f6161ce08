-- release.lua: give the lock back: delete it and wake the next waiter.
--
-- KEYS[1]  the lock hash (see acquire.lua: owner fields; a value of another type is not ours)
-- KEYS[2]  the lock's waiter queue: ":waiters", or ":fair" for the fair lock (acquire.lua)
-- KEYS[3]  fair lock only: the waiters' last-seen hash (acquire.lua)
-- KEYS[4]  fair lock only: the lock's fence counter (acquire.lua's KEYS[2])
-- KEYS[5]  fair lock only: the waiters' registered leases (acquire.lua's KEYS[5])
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
--             pops it ("released"). The fair lock hands itself over to a waiter that
--             registered a lease (KEYS[5]) when somebody receives its message,
--             "granted:<fencing token>": it becomes the owner (its token, owner record and
--             lease, the next fencing token of KEYS[4]) and leaves the queue; had it died
--             meanwhile, the lease expires by itself. Otherwise the waiter is left first in
--             line (it takes itself off when it acquires). A waiter that nobody receives for
--             is skipped (popped): on the fair lock only once it is gone (ARGV[3]) or, unless
--             it polls (an id starting with "p"), past its grace (ARGV[4]); one not skipped
--             keeps the lock free for its next attempt, as does a waiter of an older client
--             (no lease registered: its message is "released").
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
local leases = redis.call('HMGET', KEYS[5], '', unpack(queue))
local seed = fence_read(KEYS[4])
-- the fencing token a grant takes (fence_write's result; counters stay far below 2^53)
local next_fence = seed and tonumber(seed) or tonumber(redis.call('GET', KEYS[4])) + 1
-- writes from here on (PUBLISH writes no key)
local skipped = 0
local grant -- {token, lease ms, owner record} of the waiter the lock goes to
for i, waiter in ipairs(queue) do
  local at = tonumber(seen[i + 1])
  if at and now - at <= tonumber(ARGV[3]) then
    local lease, size, rest = string.match(leases[i + 1] or '', '^(%d+) (%d+) (.*)$')
    local message = 'released'
    if lease and tonumber(lease) > 0 and #rest >= tonumber(size) then
      message = 'granted:' .. string.format('%.0f', next_fence)
    else
      lease = nil
    end
    local received = redis.pcall('PUBLISH', KEYS[1] .. ':wake:' .. waiter, message)
    local heard = type(received) == 'number' and received > 0
    if heard or type(received) ~= 'number' or string.sub(waiter, 1, 1) == 'p'
        or now - at <= tonumber(ARGV[4]) then
      if lease and heard then
        local record = string.sub(rest, tonumber(size) + 1)
        grant = {string.sub(rest, 1, tonumber(size)), lease, record ~= '' and record or 1}
        skipped = i -- the new owner leaves the queue
      end
      break
    end
  end
  skipped = i
end
redis.call('DEL', KEYS[1])
if grant then
  local fence = fence_write(KEYS[4], seed)
  redis.call('HSET', KEYS[1], owner_field(grant[1]), grant[3], 'fence', fence, '#fair', 1)
  redis.call('PEXPIRE', KEYS[1], grant[2])
end
if skipped > 0 then
  redis.call('LTRIM', KEYS[2], skipped, -1)
  hdel_all(KEYS[3], {unpack(queue, 1, skipped)})
  hdel_all(KEYS[5], {unpack(queue, 1, skipped)})
end
return 1
