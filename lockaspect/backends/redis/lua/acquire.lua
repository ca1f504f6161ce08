-- acquire.lua: take a fenced lock, or report how long the holder keeps it (and queue the
-- waiter for a wake-up). One script for the lock and the fair lock (ARGV[5] == "fair").
--
-- KEYS[1]  the lock: a hash {<owner field> = <owner record>, "fence" = fencing token} (one
--          hold per owner: re-entries are counted by the client), where the owner field is
--          the owner token as it is, except that "fence" and tokens starting with "#" are
--          stored with a "#" in front (lib.lua's owner_field): no token's field is "fence".
--          The owner record is ARGV[3], or 1 when it is empty (holds.lua's owner_value; a
--          hold written before owner records were kept holds 1 too); it shares the hash's
--          TTL, so it goes with the hold. A fair lock's hash also holds "#fair" = 1 (no token's
--          field). A value of another type there (not written by lockaspect) is another
--          owner's: busy, as long as its TTL
-- KEYS[2]  the lock's fence counter (never expires: fencing tokens must keep growing)
-- KEYS[3]  the waiter queue, a list of waiter ids: for the lock ":waiters", woken one per
--          release and popped by it; for the fair lock ":fair", in arrival order, where the
--          lock goes only to the first (release.lua)
-- KEYS[4]  fair lock only (":fair:seen"): hash {waiter id = server ms of its last attempt}
-- KEYS[5]  fair lock only, optional (":fair:grant"): hash {waiter id = the lease its last busy
--          attempt would take: "<lease ms> <token length> <token><owner record>"}, which
--          release.lua grants to the first waiter (it makes that waiter the owner)
-- ARGV[1]  owner token (any string)
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  the owner record to keep with the hold ("" for none); a repeated request keeps
--          the record of the first
-- ARGV[4]  optional waiter id ("" or absent for none): if busy, queue it (once); if
--          acquired, take it off the queue
-- ARGV[5]  optional mode: "front" queues at the head (a woken waiter that lost the lock to a
--          barger), "back" at the tail, "fair" the fair lock: a free lock goes to the first
--          queued waiter, or to anyone when nobody queues; a waiter not seen for ARGV[6] ms
--          counts as gone and leaves the queue (so a dead waiter blocks it about that long)
-- ARGV[6]  fair lock only: ms after its last attempt that a waiter counts as gone
--
-- returns  fence >= 1   acquired: fence is the INCR of KEYS[2], one hold is recorded.
--                       A fair request whose token holds the lock already (a release
--                       granted it: release.lua) gets its fence and the lease from now on.
--                       A counter that does not exist yet, or that the store lost (a
--                       restart without persistence, an eviction), starts from the server
--                       clock in microseconds: above every token the lost counter issued,
--                       since a counter gains one per acquisition, far less than one per us.
--                       A request repeated with the same token (a retry after a lost
--                       reply) finds its own hold and gets the same fence again.
--          -(ms + 1)    busy: ms is the holder's remaining lease (fair lock, free but
--                       promised to the first waiter: ARGV[6], how long that one may take)
--          0            busy, and the lock has no expiry (set by hand: never by us)
-- Everything is read before the first write (lib.lua): a failing command leaves nothing.
-- include: lib.lua
local fair = ARGV[5] == 'fair'
local waiter = ARGV[4]
if waiter == '' then
  waiter = nil
end
local owner = owner_field(ARGV[1])
local record = ARGV[3] ~= '' and ARGV[3] or 1 -- holds.lua's owner_value, inline (hot path)
local now, first, queue
local gone = 0 -- fair lock: the first `gone` waiters of the queue left it (not seen lately)
if fair then
  now = server_ms()
  -- at most 64 per call (a mass crash leaves many): later attempts drop the rest
  queue = redis.call('LRANGE', KEYS[3], 0, 64)
  -- read even when the queue is empty: the hash is written below
  local seen = redis.call('HMGET', KEYS[4], waiter or '', unpack(queue))
  if KEYS[5] then
    redis.call('HEXISTS', KEYS[5], '') -- read before the writes below: fails on another type
  end
  for i = 1, math.min(#queue, 64) do
    local at = tonumber(seen[i + 1])
    if at and now - at <= tonumber(ARGV[6]) then
      break
    end
    gone = i
  end
  first = queue[gone + 1]
end
local pttl = redis.call('PTTL', KEYS[1])
local takes = pttl == -2 and not (first and first ~= waiter)
local seed, queued
if takes then
  seed = fence_read(KEYS[2])
end
if waiter and not fair then
  queued = redis.call('LPOS', KEYS[3], waiter)
end
local fence
if pttl ~= -2 and read('HEXISTS', KEYS[1], owner) == 1 then
  fence = tonumber(redis.call('HGET', KEYS[1], 'fence'))
end
-- writes from here on
if gone > 0 then
  redis.call('LTRIM', KEYS[3], gone, -1)
  hdel_all(KEYS[4], {unpack(queue, 1, gone)})
  if KEYS[5] then
    hdel_all(KEYS[5], {unpack(queue, 1, gone)})
  end
end
if takes then
  fence = fence_write(KEYS[2], seed)
  if fair then
    redis.call('HSET', KEYS[1], owner, record, 'fence', fence, '#fair', 1)
  else
    redis.call('HSET', KEYS[1], owner, record, 'fence', fence)
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if waiter then
    if fair then
      redis.call('LREM', KEYS[3], 0, waiter)
      redis.call('HDEL', KEYS[4], waiter)
      if KEYS[5] then
        redis.call('HDEL', KEYS[5], waiter)
      end
    elseif queued then
      redis.call('LREM', KEYS[3], 0, waiter)
    end
  end
  return fence
end
if fence then
  if fair then
    redis.call('PEXPIRE', KEYS[1], ARGV[2]) -- granted while we waited: trusted from this request
  end
  return fence
end
if waiter then
  if fair then
    queued = redis.call('LPOS', KEYS[3], waiter)
  end
  if not queued then
    if ARGV[5] == 'front' then
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
    if KEYS[5] then
      redis.call('HSET', KEYS[5], waiter, ARGV[2] .. ' ' .. #ARGV[1] .. ' ' .. ARGV[1] .. ARGV[3])
      redis.call('PEXPIRE', KEYS[5], 60000)
    end
  end
end
if pttl == -2 then
  return -(tonumber(ARGV[6]) + 1)
end
if pttl == -1 then
  return 0
end
return -(pttl + 1)
