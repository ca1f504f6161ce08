-- sem_set.lua: change the number of permits of a semaphore (set_permits), or read it.
--
-- KEYS[1]  the holders (see sem_acquire.lua)
-- KEYS[2]  the number of permits
-- KEYS[3]  the waiter queue
-- ARGV[1]  the new number of permits, or "" to only read
-- ARGV[2]  the wake-up channel prefix (see sem_release.lua)
--
-- returns  {permits or -1 when never set, permits in use (not expired)}. Raising the number
--          wakes up to that many more queued waiters; lowering it takes no permit away (the
--          holders keep theirs; new ones wait until fewer are held than the new number).
-- Everything is read before the first write (lib.lua): a failing command leaves nothing.
-- include: lib.lua
local now = server_ms()
local in_use = redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
local old = tonumber(redis.call('GET', KEYS[2]))
if ARGV[1] == '' then
  return {old or -1, in_use}
end
local new = tonumber(ARGV[1])
-- writes from here on: the wake-up first (its LPOP fails, if the queue holds another type,
-- before anything is written)
wake(KEYS[3], ARGV[2], math.min(16, math.max(0, new - (old or 0))), false)
redis.call('SET', KEYS[2], new)
return {new, in_use}
