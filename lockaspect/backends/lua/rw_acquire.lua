-- rw_acquire.lua: take a read-write lock for reading (shared) or writing (exclusive), or
-- report how long until it may be free (and queue the waiter for a wake-up).
--
-- KEYS[1]  the writer: a hash {<owner token> = 1, "fence" = fencing token}, expiring with its lease
-- KEYS[2]  the readers: a sorted set {<owner token> = server ms when its lease ends}
-- KEYS[3]  the readers' fencing tokens: a hash {<owner token> = fence}
-- KEYS[4]  the waiting writers: a sorted set {<writer waiter id> = server ms of its last attempt}
-- KEYS[5]  the waiter queue: a list of waiter ids, woken on release (rw_release.lua)
-- KEYS[6]  the fence counter (see acquire.lua; shared with a lock of the same name)
-- ARGV[1]  owner token
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  "read" or "write"
-- ARGV[4]  waiter id ("" for none): if busy, queue it (once); if acquired, take it off
-- ARGV[5]  ms after its last attempt that a waiting writer counts as gone
-- ARGV[6]  read: the token of the write lock the caller holds ("" for none): a writer may
--          also take the read lock (downgrade) although it holds the write lock
--
-- Writers are preferred: while a writer waits (made an attempt in the last ARGV[5] ms), new
-- readers wait too, so a stream of readers cannot starve writers. A writer is let in once
-- the readers that hold the lock leave (or their leases end).
--
-- returns  {1, fence}   acquired; a repeated request with the same token gets the same fence
--          {0, ms}      busy: ms until the writer's or the first reader's lease ends (at least 1)
-- include: lib.lua
local now = server_ms()
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  hdel_all(KEYS[3], expired)
end
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - tonumber(ARGV[5]))
local waiter = ARGV[4]
if waiter == '' then
  waiter = nil
end
local writing = ARGV[3] == 'write'
local free
if writing then
  if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
    return {1, tonumber(redis.call('HGET', KEYS[1], 'fence'))}
  end
  free = redis.call('EXISTS', KEYS[1]) == 0 and redis.call('ZCARD', KEYS[2]) == 0
  if free then
    local fence = next_fence(KEYS[6])
    redis.call('HSET', KEYS[1], ARGV[1], 1, 'fence', fence)
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    if waiter then
      redis.call('ZREM', KEYS[4], waiter)
      redis.call('LREM', KEYS[5], 0, waiter)
    end
    return {1, fence}
  end
  if waiter then
    redis.call('ZADD', KEYS[4], now, waiter)
    redis.call('PEXPIRE', KEYS[4], 60000)
  end
else
  local own = redis.call('HGET', KEYS[3], ARGV[1])
  if own and redis.call('ZSCORE', KEYS[2], ARGV[1]) then
    return {1, tonumber(own)}
  end
  local downgrade = ARGV[6] ~= '' and redis.call('HEXISTS', KEYS[1], ARGV[6]) == 1
  free = downgrade or (redis.call('EXISTS', KEYS[1]) == 0 and redis.call('ZCARD', KEYS[4]) == 0)
  if free then
    local fence = next_fence(KEYS[6])
    redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
    redis.call('HSET', KEYS[3], ARGV[1], fence)
    local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
    local ttl = math.max(1, tonumber(last[2]) - now)
    redis.call('PEXPIRE', KEYS[2], ttl)
    redis.call('PEXPIRE', KEYS[3], ttl)
    if waiter then
      redis.call('LREM', KEYS[5], 0, waiter)
    end
    return {1, fence}
  end
end
if waiter then
  if not redis.call('LPOS', KEYS[5], waiter) then
    redis.call('RPUSH', KEYS[5], waiter)
  end
  redis.call('PEXPIRE', KEYS[5], 60000)
end
local hint = redis.call('PTTL', KEYS[1])
if hint < 0 then
  local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  hint = first[2] and (tonumber(first[2]) - now) or tonumber(ARGV[5])
end
return {0, math.max(1, hint)}
