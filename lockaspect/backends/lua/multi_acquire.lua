-- multi_acquire.lua: take several locks all at once for one owner, or none of them.
--
-- KEYS[3i-2]  the lock hash of the i-th key (see acquire.lua), keys in the caller's order
-- KEYS[3i-1]  its fence counter
-- KEYS[3i]    its waiter queue (see acquire.lua)
-- ARGV[1]     owner token (the same for every key)
-- ARGV[2]     lease in milliseconds
-- ARGV[3]     the caller's own waiter id ("" for none): if a key is busy, queue it there
--             (once); once acquired, take it off every queue
--
-- returns  {1, fence_1, ..., fence_n}  every key is held by the token (taken now, or already
--                                     its own: a repeated request gets the same fences)
--          {0, i, ms}                 the i-th key is held by another owner for ms more (-1:
--                                     no expiry); nothing was taken
-- One script, so the set is taken atomically: two callers with overlapping sets can never
-- each hold a part and wait for the other (no deadlock, nothing to roll back). A busy answer
-- passes on the wake-up of every earlier key of the set that is free: this caller may have
-- been woken for it, and must not keep the waiters queued there from hearing of it.
-- include: lib.lua
local n = #KEYS / 3
local waiter = ARGV[3]
if waiter == '' then
  waiter = nil
end
for i = 1, n do
  local lock = KEYS[3 * i - 2]
  if redis.call('EXISTS', lock) == 1 and redis.call('HEXISTS', lock, ARGV[1]) == 0 then
    for j = 1, i - 1 do
      if redis.call('EXISTS', KEYS[3 * j - 2]) == 0 then
        wake(KEYS[3 * j], KEYS[3 * j - 2], 16, true)
      end
    end
    if waiter then
      if not redis.call('LPOS', KEYS[3 * i], waiter) then
        redis.call('RPUSH', KEYS[3 * i], waiter)
      end
      redis.call('PEXPIRE', KEYS[3 * i], 60000)
    end
    return {0, i, redis.call('PTTL', lock)}
  end
end
local reply = {1}
for i = 1, n do
  local lock = KEYS[3 * i - 2]
  if redis.call('HEXISTS', lock, ARGV[1]) == 1 then
    reply[i + 1] = tonumber(redis.call('HGET', lock, 'fence'))
  else
    local fence = next_fence(KEYS[3 * i - 1])
    redis.call('HSET', lock, ARGV[1], 1, 'fence', fence)
    redis.call('PEXPIRE', lock, ARGV[2])
    reply[i + 1] = fence
  end
  if waiter then
    redis.call('LREM', KEYS[3 * i], 0, waiter)
  end
end
return reply
