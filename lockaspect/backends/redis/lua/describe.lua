-- describe.lua: what is held under one key, for the operator tools (AdminStore.describe).
-- Reads only.
--
-- KEYS[1]  the lock (acquire.lua)                 KEYS[2]   the lock's waiter queue
-- KEYS[3]  the fair lock's waiter queue           KEYS[4]   the semaphore's holders
-- KEYS[5]  the semaphore holders' fencing tokens  KEYS[6]   the semaphore's waiter queue
-- KEYS[7]  the semaphore's number of permits      KEYS[8]   the read-write lock's writer
-- KEYS[9]  its readers                            KEYS[10]  the readers' fencing tokens
-- KEYS[11] the read-write lock's waiter queue
--
-- returns  one entry per kind held, each {kind, holders, ms left (-1: no expiry), fencing
--          token (-1: none), waiters, permits (-1: not set, or not a semaphore)}:
--          "lock", or "fair" while the fair queue holds waiters (the hash is the same); for
--          a semaphore or the readers, the live holders (expired ones are not counted), the
--          ms until the last of their leases ends and the largest of their fencing tokens;
--          "write" for the writer. A value of another type at a holder key (not written by
--          lockaspect) counts as one holder without a fencing token.
-- include: lib.lua
local now = server_ms()

local function llen(queue)
  return read('LLEN', queue) or 0
end

local function left(key)
  local pttl = redis.call('PTTL', key)
  return pttl < 0 and -1 or pttl
end

-- a hash {<owner field> = 1, "fence" = fencing token} with the lease as its TTL
local function hash_entry(kind, key, waiters)
  local kind_of = redis.call('TYPE', key)['ok']
  if kind_of == 'none' then
    return nil
  end
  if kind_of ~= 'hash' then
    return {kind, 1, left(key), -1, waiters, -1}
  end
  local fence = tonumber(redis.call('HGET', key, 'fence'))
  return {kind, redis.call('HLEN', key) - (fence and 1 or 0), left(key), fence or -1, waiters, -1}
end

-- a sorted set {<owner token> = server ms when its lease ends}, fences {<owner token> = fence}
local function zset_entry(kind, key, fences, waiters, permits)
  local kind_of = redis.call('TYPE', key)['ok']
  if kind_of == 'none' then
    return nil
  end
  if kind_of ~= 'zset' then
    return {kind, 1, left(key), -1, waiters, permits}
  end
  local live = redis.call('ZRANGEBYSCORE', key, '(' .. now, '+inf', 'WITHSCORES')
  if #live == 0 then
    return nil
  end
  local tokens = {}
  for i = 1, #live, 2 do
    tokens[#tokens + 1] = live[i]
  end
  local fence = -1
  for i = 1, #tokens, 1000 do
    local values = read('HMGET', fences, unpack(tokens, i, math.min(i + 999, #tokens))) or {}
    for _, value in ipairs(values) do
      local number = tonumber(value)
      if number and number > fence then
        fence = number
      end
    end
  end
  return {kind, #tokens, tonumber(live[#live]) - now, fence, waiters, permits}
end

local states = {}
local function add(entry)
  if entry then
    states[#states + 1] = entry
  end
end

local fair_waiters = llen(KEYS[3])
add(hash_entry(fair_waiters > 0 and 'fair' or 'lock', KEYS[1], llen(KEYS[2]) + fair_waiters))
add(zset_entry('semaphore', KEYS[4], KEYS[5], llen(KEYS[6]), tonumber(read('GET', KEYS[7])) or -1))
local rw_waiters = llen(KEYS[11])
add(hash_entry('write', KEYS[8], rw_waiters))
add(zset_entry('read', KEYS[9], KEYS[10], rw_waiters, -1))
return states
