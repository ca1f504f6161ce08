-- sem_acquire.lua: take `weight` permits of a semaphore at once (all or none), each hold
-- expiring with its lease, or report how long until the first hold expires (and queue the
-- waiter for a wake-up).
--
-- KEYS[1]  the holders: a sorted set {<owner token> = server ms when its hold expires}. A
--          value of another type there (not written by lockaspect) holds every permit: busy
-- KEYS[2]  the number of permits (a string; it never expires, set_permits changes it)
-- KEYS[3]  the fence counter (see acquire.lua; shared with a lock of the same name)
-- KEYS[4]  the waiter queue (as the lock's ":waiters", see acquire.lua and release.lua)
-- KEYS[5]  each holder's fencing token and owner record: a hash {<owner token> = "<fence>"
--          or "<fence> <owner record>"} (holds.lua's share_value)
-- KEYS[6]  each holder's weight: a hash {<owner token> = permits held}, for the holders of
--          more than one permit (a holder not in it holds one)
--          KEYS[5] and KEYS[6] live at least as long as the holds they hold entries of
--          (each write sets the TTL of KEYS[1], the longest hold; sem_renew.lua extends
--          each), and lose a holder's entries when its hold is released or found expired
-- ARGV[1]  owner token
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  the number of permits the caller expects
-- ARGV[4]  optional waiter id ("" for none): if busy, queue it (once); if acquired, take it off
-- ARGV[5]  "front" to queue at the head (a woken waiter that lost the permit), else "back"
-- ARGV[6]  the owner record to keep with the hold ("" or absent for none)
-- ARGV[7]  the permits to take (the hold's weight, 1 to ARGV[3]; absent: 1)
--
-- returns  {1, fence}   acquired: the permits in use (the live holders' weights summed) plus
--                       ARGV[7] did not exceed the permits. A repeated request with the same
--                       token gets the same fence (and keeps the first record and weight)
--          {0, ms}      not enough permits free: ms until the first hold expires (at least
--                       1); -1 when none will: a value of another type without expiry holds
--                       the key, or no hold is live (the semaphore has too few permits)
--          {-1, n}      the semaphore has n permits, not ARGV[3]: nothing changed
-- Expired holds are dropped first: a dead holder's permits come back when its lease ends.
-- Everything is read before the first write (lib.lua): a failing command leaves nothing.
-- include: lib.lua
-- include: holds.lua
local now = server_ms()
local expired, foreign = read('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if foreign then
  local pttl = redis.call('PTTL', KEYS[1])
  return {0, pttl < 0 and -1 or math.max(1, pttl)}
end
local wanted = tonumber(ARGV[3])
local permits = tonumber(redis.call('GET', KEYS[2]))
if permits and permits ~= wanted then
  return {-1, permits}
end
local weight = tonumber(ARGV[7]) or 1
local own = redis.call('HGET', KEYS[5], ARGV[1])
local expires = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]))
local held = own and expires and expires > now
local waiter = ARGV[4]
if waiter == '' then
  waiter = nil
end
local queued = waiter and redis.call('LPOS', KEYS[4], waiter)
local in_use, dead = sem_in_use(KEYS[1], KEYS[6], now)
local seed, last, first
local takes = not held and in_use + weight <= (permits or wanted)
if takes then
  seed = fence_read(KEYS[3])
  last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
elseif not held then
  first = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
end
-- writes from here on
if not permits then
  redis.call('SET', KEYS[2], wanted)
end
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  hdel_all(KEYS[5], expired)
end
if #dead > 0 then
  hdel_all(KEYS[6], dead)
end
if held then
  return {1, share_fence(own)}
end
if takes then
  local fence = fence_write(KEYS[3], seed)
  local ends = now + tonumber(ARGV[2])
  redis.call('ZADD', KEYS[1], ends, ARGV[1])
  redis.call('HSET', KEYS[5], ARGV[1], share_value(fence, ARGV[6]))
  -- the holders' keys live as long as their longest hold
  local ttl = math.max(1, math.max(ends, tonumber(last[2]) or 0) - now)
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[5], ttl)
  if weight > 1 then
    redis.call('HSET', KEYS[6], ARGV[1], weight)
    redis.call('PEXPIRE', KEYS[6], ttl)
  end
  if queued then
    redis.call('LREM', KEYS[4], 0, waiter)
  end
  return {1, fence}
end
if waiter then
  if not queued then
    if ARGV[5] == 'front' then
      redis.call('LPUSH', KEYS[4], waiter)
    else
      redis.call('RPUSH', KEYS[4], waiter)
    end
  end
  redis.call('PEXPIRE', KEYS[4], 60000)
end
if not first[2] then
  return {0, -1} -- no hold is live, and still too few permits: nothing to wait for
end
return {0, math.max(1, tonumber(first[2]) - now)}
