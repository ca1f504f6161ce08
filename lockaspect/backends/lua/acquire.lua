-- acquire.lua: take a fenced lock, or report how long the holder keeps it (and queue the
-- waiter for a wake-up). One script for the lock and the fair lock (ARGV[4] == "fair").
--
-- KEYS[1]  the lock: a hash {<owner token> = hold count, "fence" = fencing token}
-- KEYS[2]  the lock's fence counter (never expires: fencing tokens must keep growing)
-- KEYS[3]  the waiter queue, a list of waiter ids: for the lock ":waiters", woken one per
--          release and popped by it; for the fair lock ":fair", in arrival order, where the
--          lock goes only to the first (release.lua)
-- KEYS[4]  fair lock only (":fair:seen"): hash {waiter id = server ms of its last attempt}
-- ARGV[1]  owner token (32 hex characters, never equal to "fence")
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  optional waiter id ("" for none): if busy, queue it (once); if acquired, take it
--          off the queue
-- ARGV[4]  optional mode: "front" queues at the head (a woken waiter that lost the lock to a
--          barger), "back" at the tail, "fair" the fair lock: a free lock goes to the first
--          queued waiter, or to anyone when nobody queues; a waiter not seen for ARGV[5] ms
--          counts as gone and leaves the queue (so a dead waiter blocks it that long at most)
-- ARGV[5]  fair lock only: ms after its last attempt that a waiter counts as gone
--
-- returns  fence >= 1   acquired: fence is the INCR of KEYS[2], one hold is recorded.
--                       A counter that does not exist yet, or that the store lost (a
--                       restart without persistence, an eviction), starts from the server
--                       clock in microseconds: above every token the lost counter issued,
--                       since a counter gains one per acquisition, far less than one per us.
--                       A request repeated with the same token (a retry after a lost
--                       reply) finds its own hold and gets the same fence again.
--          -(ms + 1)    busy: ms is the holder's remaining lease (fair lock, free but
--                       promised to the first waiter: ARGV[5], how long that one may take)
--          0            busy, and the lock has no expiry (set by hand: never by us)
-- include: lib.lua
local fair = ARGV[4] == 'fair'
local waiter = ARGV[3]
if waiter == '' then
  waiter = nil
end
local now, first
if fair then
  now = server_ms()
  first = redis.call('LINDEX', KEYS[3], 0)
  -- at most 64 per call (a mass crash leaves many): later attempts drop the rest
  for _ = 1, 64 do
    if not first then
      break
    end
    local seen = tonumber(redis.call('HGET', KEYS[4], first))
    if seen and now - seen <= tonumber(ARGV[5]) then
      break
    end
    redis.call('LPOP', KEYS[3])
    redis.call('HDEL', KEYS[4], first)
    first = redis.call('LINDEX', KEYS[3], 0)
  end
end
local pttl = redis.call('PTTL', KEYS[1])
if pttl == -2 and not (first and first ~= waiter) then
  local fence = next_fence(KEYS[2])
  redis.call('HSET', KEYS[1], ARGV[1], 1, 'fence', fence)
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if waiter then
    redis.call('LREM', KEYS[3], 0, waiter)
    if fair then
      redis.call('HDEL', KEYS[4], waiter)
    end
  end
  return fence
end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  return tonumber(redis.call('HGET', KEYS[1], 'fence'))
end
if waiter then
  if not redis.call('LPOS', KEYS[3], waiter) then
    if ARGV[4] == 'front' then
      redis.call('LPUSH', KEYS[3], waiter)
    else
      redis.call('RPUSH', KEYS[3], waiter)
    end
  end
  -- waiters re-queue on every attempt, so a queue whose waiters all died soon expires
  redis.call('PEXPIRE', KEYS[3], 60000)
  if fair then
    redis.call('HSET', KEYS[4], waiter, now)
    redis.call('PEXPIRE', KEYS[4], 60000)
  end
end
if pttl == -2 then
  return -(tonumber(ARGV[5]) + 1)
end
if pttl == -1 then
  return 0
end
return -(pttl + 1)
