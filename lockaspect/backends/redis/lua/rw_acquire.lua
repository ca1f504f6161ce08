-- rw_acquire.lua: take a read-write lock for reading (shared) or writing (exclusive), or
-- report how long until it may be free (and queue the waiter for a wake-up).
--
-- KEYS[1]  the writer: a hash {<owner field> = <owner record>, "fence" = fencing token},
--          expiring with its lease (owner fields and records as in acquire.lua: no token's
--          field is "fence"; a hold without a record, or written before records were kept,
--          holds 1)
-- KEYS[2]  the readers: a sorted set {<owner token> = server ms when its lease ends}
-- KEYS[3]  the readers' fencing tokens and owner records: a hash {<owner token> = "<fence>"
--          or "<fence> <owner record>"} (holds.lua's share_value)
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
-- ARGV[7]  the owner record to keep with the hold ("" for none); a repeated request keeps
--          the record of the first
--
-- Writers are preferred: while a writer waits (made an attempt in the last ARGV[5] ms), new
-- readers wait too, so a stream of readers cannot starve writers. A writer is let in once
-- the readers that hold the lock leave (or their leases end). A value of another type in
-- KEYS[1] or KEYS[2] (not written by lockaspect) is another owner's: busy.
--
-- returns  {1, fence}   acquired; a repeated request with the same token gets the same fence
--          {0, ms}      busy: ms until the writer's or the first reader's lease ends (at
--                       least 1); -1: a value of another type without expiry holds the lock
-- Everything is read before the first write (lib.lua): a failing command leaves nothing.
-- include: lib.lua
-- include: holds.lua
local now = server_ms()
local writing = ARGV[3] == 'write'
local expired, foreign = read('ZRANGEBYSCORE', KEYS[2], '-inf', now)
local foreign_key = foreign and KEYS[2]
local mine
if not foreign_key and writing then
  mine, foreign = read('HEXISTS', KEYS[1], owner_field(ARGV[1]))
  foreign_key = foreign and KEYS[1]
end
if foreign_key then
  local pttl = redis.call('PTTL', foreign_key)
  return {0, pttl < 0 and -1 or math.max(1, pttl)}
end
-- waiting writers: those not seen for ARGV[5] ms are gone (stale), the others keep readers out
local writers = redis.call('ZCARD', KEYS[4])
local stale = writers > 0 and redis.call('ZCOUNT', KEYS[4], '-inf', now - tonumber(ARGV[5])) or 0
local waiter = ARGV[4]
if waiter == '' then
  waiter = nil
end
local fence, free, own
if writing then
  if mine == 1 then
    fence = tonumber(redis.call('HGET', KEYS[1], 'fence'))
  else
    free = redis.call('EXISTS', KEYS[1]) == 0 and redis.call('ZCOUNT', KEYS[2], '(' .. now, '+inf') == 0
  end
  if #expired > 0 then
    redis.call('HLEN', KEYS[3]) -- read before the HDEL below: fails on another type
  end
else
  own = redis.call('HGET', KEYS[3], ARGV[1])
  local expires = own and tonumber(redis.call('ZSCORE', KEYS[2], ARGV[1]))
  if own and expires and expires > now then
    fence = share_fence(own)
  else
    local downgrade = ARGV[6] ~= '' and read('HEXISTS', KEYS[1], owner_field(ARGV[6])) == 1
    free = downgrade or (writers - stale == 0 and redis.call('EXISTS', KEYS[1]) == 0)
  end
end
local seed, last, queued, hint
if free then
  seed = fence_read(KEYS[6])
  if not writing then
    last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
  end
end
if waiter and not fence then
  queued = redis.call('LPOS', KEYS[5], waiter)
end
if not (fence or free) then
  hint = redis.call('PTTL', KEYS[1])
  if hint < 0 then
    local first = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. now, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    hint = first[2] and (tonumber(first[2]) - now) or tonumber(ARGV[5])
  end
end
-- writes from here on
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  hdel_all(KEYS[3], expired)
end
if stale > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - tonumber(ARGV[5]))
end
if fence then
  return {1, fence}
end
if free then
  fence = fence_write(KEYS[6], seed)
  if writing then
    redis.call('HSET', KEYS[1], owner_field(ARGV[1]), owner_value(ARGV[7]), 'fence', fence)
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    if waiter then
      redis.call('ZREM', KEYS[4], waiter)
    end
  else
    local ends = now + tonumber(ARGV[2])
    redis.call('ZADD', KEYS[2], ends, ARGV[1])
    redis.call('HSET', KEYS[3], ARGV[1], share_value(fence, ARGV[7]))
    local ttl = math.max(1, math.max(ends, tonumber(last[2]) or 0) - now)
    redis.call('PEXPIRE', KEYS[2], ttl)
    redis.call('PEXPIRE', KEYS[3], ttl)
  end
  if queued then
    redis.call('LREM', KEYS[5], 0, waiter)
  end
  return {1, fence}
end
if waiter then
  if writing then
    redis.call('ZADD', KEYS[4], now, waiter)
    redis.call('PEXPIRE', KEYS[4], 60000)
  end
  if not queued then
    redis.call('RPUSH', KEYS[5], waiter)
  end
  redis.call('PEXPIRE', KEYS[5], 60000)
end
return {0, math.max(1, hint)}
