-- force_release.lua: delete every hold of one key, whoever holds it, and wake its waiters as
-- the release scripts do (AdminStore.force_release). The fence counter stays, so fencing
-- tokens keep increasing; so do a semaphore's number of permits and the waiters' queues.
--
-- KEYS[1]  the lock (acquire.lua)                 KEYS[2]   the lock's waiter queue
-- KEYS[3]  the fair lock's waiter queue           KEYS[4]   the semaphore's holders
-- KEYS[5]  the semaphore holders' fencing tokens  KEYS[6]   the semaphore's waiter queue
-- KEYS[7]  the read-write lock's writer           KEYS[8]   its readers
-- KEYS[9]  the readers' fencing tokens            KEYS[10]  the read-write lock's waiter queue
-- KEYS[11] the semaphore holders' weights
-- (owner records are kept in KEYS[1], KEYS[5], KEYS[7] and KEYS[9]: see describe.lua)
-- ARGV[1]  the wake-up channel prefix: a waiter is woken on ARGV[1] .. ":wake:" .. <its id>
--
-- returns  1  something was held (the lock, a live permit, the writer, a live reader, or a
--             value of another type at one of those keys: not written by lockaspect); it is
--             deleted with every holder's fencing token, owner record and weight, and
--             the waiters of what was held are woken: the lock's first waiter still
--             listening (popped, as release.lua), the fair lock's first waiter still
--             listening (left first in line, as release.lua), up to 16 waiters of the
--             semaphore and of the read-write lock (popped, as sem_set.lua and rw_release.lua)
--          0  nothing was held (expired holders are deleted all the same)
-- Everything is read before the first write (lib.lua): a failing command leaves nothing.
-- include: lib.lua
local now = server_ms()

local function holds(key, sorted)
  local kind_of = redis.call('TYPE', key)['ok']
  if kind_of == 'none' then
    return false
  end
  if sorted and kind_of == 'zset' then
    return redis.call('ZCOUNT', key, '(' .. now, '+inf') > 0
  end
  return true
end

-- a queue wake() may pop (one of another type is left alone: its LPOP would fail)
local function queue(key)
  return redis.call('TYPE', key)['ok'] == 'list'
end

local lock, sem = holds(KEYS[1], false), holds(KEYS[4], true)
local rw = holds(KEYS[7], false)
rw = holds(KEYS[8], true) or rw
local fair_queue = lock and queue(KEYS[3]) and redis.call('LRANGE', KEYS[3], 0, 15) or {}
local wake_lock = lock and queue(KEYS[2])
local wake_sem = sem and queue(KEYS[6])
local wake_rw = rw and queue(KEYS[10])
-- writes from here on (DEL cannot fail, wake pops lists only; PUBLISH writes no key)
redis.call('DEL', KEYS[1], KEYS[4], KEYS[5], KEYS[7], KEYS[8], KEYS[9], KEYS[11])
if wake_lock then
  wake(KEYS[2], ARGV[1], 16, true)
end
for _, waiter in ipairs(fair_queue) do
  local received = redis.pcall('PUBLISH', ARGV[1] .. ':wake:' .. waiter, 'released')
  if type(received) ~= 'number' or received > 0 then
    break
  end
end
if wake_sem then
  wake(KEYS[6], ARGV[1], 16, false)
end
if wake_rw then
  wake(KEYS[10], ARGV[1], 16, false)
end
return (lock or sem or rw) and 1 or 0
