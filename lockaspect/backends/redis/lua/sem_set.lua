-- sem_set.lua: change the number of permits of a semaphore (set_permits, add_permits), or
-- read it.
--
-- KEYS[1]  the holders (see sem_acquire.lua)
-- KEYS[2]  the number of permits
-- KEYS[3]  the waiter queue
-- KEYS[4]  the holders' weights (see sem_acquire.lua)
-- ARGV[1]  the new number of permits, or "" to only read; with ARGV[3] "add", the number to
--          add to the permits (negative: to take away)
-- ARGV[2]  the wake-up channel prefix (see sem_release.lua)
-- ARGV[3]  optional: "add" (see ARGV[1])
--
-- returns  {permits or -1 when never set, permits in use (the live holders' weights summed)}.
--          "add" starts a semaphore whose permits were never set from 0, and never goes
--          below 0. Raising the number wakes up to that many more queued waiters (at most
--          16); lowering it takes no permit away (the holders keep theirs; new holds wait
--          until in use plus their weight fits the new number).
-- Everything is read before the first write (lib.lua): a failing command leaves nothing.
-- include: lib.lua
-- include: holds.lua
local now = server_ms()
local in_use = sem_in_use(KEYS[1], KEYS[4], now)
local old = tonumber(redis.call('GET', KEYS[2]))
if ARGV[1] == '' then
  return {old or -1, in_use}
end
local new = tonumber(ARGV[1])
if ARGV[3] == 'add' then
  new = math.max(0, (old or 0) + new)
end
-- writes from here on: the wake-up first (its LPOP fails, if the queue holds another type,
-- before anything is written)
wake(KEYS[3], ARGV[2], math.min(16, math.max(0, new - (old or 0))), false)
redis.call('SET', KEYS[2], new)
return {new, in_use}
