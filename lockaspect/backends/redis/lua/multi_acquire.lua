-- multi_acquire.lua: take several locks all at once for one owner, or none of them.
--
-- KEYS[3i-2]  the lock hash of the i-th key (see acquire.lua: owner fields holding owner
--             records, and a value of another type counts as another owner's), keys in the
--             caller's order
-- KEYS[3i-1]  its fence counter
-- KEYS[3i]    its waiter queue (see acquire.lua)
-- ARGV[1]     owner token (the same for every key; any string)
-- ARGV[2]     lease in milliseconds
-- ARGV[3]     the caller's own waiter id ("" for none): if a key is busy, queue it there
--             (once); once acquired, take it off every queue
-- ARGV[4]     the owner record to keep with each hold ("" for none; see acquire.lua)
--
-- returns  {1, fence_1, ..., fence_n}  every key is held by the token (taken now, or already
--                                     its own: a repeated request gets the same fences)
--          {0, i, ms}                 the i-th key is held by another owner for ms more (-1:
--                                     no expiry); nothing was taken
-- One script, so the set is taken atomically: two callers with overlapping sets can never
-- each hold a part and wait for the other (no deadlock, nothing to roll back). A busy answer
-- passes on the wake-up of every earlier key of the set that is free: this caller may have
-- been woken for it, and must not keep the waiters queued there from hearing of it.
-- Everything is read before the first write (lib.lua): a failing command leaves nothing.
-- include: lib.lua
local n = #KEYS / 3
local waiter = ARGV[3]
if waiter == '' then
  waiter = nil
end
local owner = owner_field(ARGV[1])
local record = ARGV[4] ~= '' and ARGV[4] or 1 -- holds.lua's owner_value
-- per key: takes[i] (free: take it, seeds[i] for fence_write), fences[i] (already ours), or
-- same[i] (the lock of an earlier index, repeated)
local takes, seeds, fences, same, first = {}, {}, {}, {}, {}
for i = 1, n do
  local lock = KEYS[3 * i - 2]
  local pttl = redis.call('PTTL', lock)
  if first[lock] then
    same[i] = first[lock]
  elseif pttl == -2 then
    takes[i] = true
    seeds[i] = fence_read(KEYS[3 * i - 1])
  elseif read('HEXISTS', lock, owner) == 1 then
    fences[i] = tonumber(redis.call('HGET', lock, 'fence'))
  else
    -- busy: wake the waiters of the earlier keys that are free, queue ours here
    local wakes = {}
    for j = 1, i - 1 do
      if takes[j] and redis.call('LLEN', KEYS[3 * j]) > 0 then
        wakes[#wakes + 1] = j
      end
    end
    local queued = waiter and redis.call('LPOS', KEYS[3 * i], waiter)
    -- writes from here on
    for _, j in ipairs(wakes) do
      wake(KEYS[3 * j], KEYS[3 * j - 2], 16, true)
    end
    if waiter then
      if not queued then
        redis.call('RPUSH', KEYS[3 * i], waiter)
      end
      redis.call('PEXPIRE', KEYS[3 * i], 60000)
    end
    return {0, i, pttl}
  end
  first[lock] = first[lock] or i
end
local queued = {}
if waiter then
  for i = 1, n do
    queued[i] = not same[i] and redis.call('LPOS', KEYS[3 * i], waiter)
  end
end
-- writes from here on
local reply = {1}
for i = 1, n do
  local lock = KEYS[3 * i - 2]
  if same[i] then
    reply[i + 1] = reply[same[i] + 1]
  elseif takes[i] then
    local fence = fence_write(KEYS[3 * i - 1], seeds[i])
    redis.call('HSET', lock, owner, record, 'fence', fence)
    redis.call('PEXPIRE', lock, ARGV[2])
    reply[i + 1] = fence
  else
    reply[i + 1] = fences[i]
  end
  if queued[i] then
    redis.call('LREM', KEYS[3 * i], 0, waiter)
  end
end
return reply
