-- acquire.lua: take a fenced lock, or report how long the holder keeps it (and queue the
-- waiter for a wake-up).
--
-- KEYS[1]  the lock: a hash {<owner token> = hold count, "fence" = fencing token}
-- KEYS[2]  the lock's fence counter (never expires: fencing tokens must keep growing)
-- KEYS[3]  the lock's waiter queue: a list of waiter ids, woken one per release (release.lua)
-- ARGV[1]  owner token (32 hex characters, never equal to "fence")
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  optional waiter id: if busy, queue it (once); if acquired, take it off the queue
-- ARGV[4]  optional "front": queue at the head (a woken waiter that lost the lock to a barger)
--
-- returns  fence >= 1   acquired: fence is the INCR of KEYS[2], one hold is recorded.
--                       A counter that does not exist yet, or that the store lost (a
--                       restart without persistence, an eviction), starts from the server
--                       clock in microseconds: above every token the lost counter issued,
--                       since a counter gains one per acquisition, far less than one per us.
--                       A request repeated with the same token (a retry after a lost
--                       reply) finds its own hold and gets the same fence again.
--          -(pttl + 1)  busy: pttl is the holder's remaining lease in milliseconds
--          0            busy, and the lock has no expiry (set by hand: never by us)
local pttl = redis.call('PTTL', KEYS[1])
if pttl == -2 then
  local fence = redis.call('INCR', KEYS[2])
  if fence == 1 then
    local now = redis.call('TIME')
    local start = now[1] .. string.format('%06d', tonumber(now[2]))
    redis.call('SET', KEYS[2], start)
    fence = tonumber(start)
  end
  redis.call('HSET', KEYS[1], ARGV[1], 1, 'fence', fence)
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if ARGV[3] then
    redis.call('LREM', KEYS[3], 0, ARGV[3])
  end
  return fence
end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  return tonumber(redis.call('HGET', KEYS[1], 'fence'))
end
if ARGV[3] then
  if not redis.call('LPOS', KEYS[3], ARGV[3]) then
    if ARGV[4] == 'front' then
      redis.call('LPUSH', KEYS[3], ARGV[3])
    else
      redis.call('RPUSH', KEYS[3], ARGV[3])
    end
  end
  -- waiters re-queue on every attempt, so a queue whose waiters all died soon expires
  redis.call('PEXPIRE', KEYS[3], 60000)
end
if pttl == -1 then
  return 0
end
return -(pttl + 1)
