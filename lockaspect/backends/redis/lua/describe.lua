-- describe.lua: what is held under one key, and by whom, for the operator tools
-- (AdminStore.describe). Reads only.
--
-- KEYS[1]  the lock (acquire.lua)
-- KEYS[2]  the lock's waiter queue
-- KEYS[3]  the fair lock's waiter queue
-- KEYS[4]  the semaphore's holders (sem_acquire.lua)
-- KEYS[5]  the semaphore holders' fencing tokens and owner records
-- KEYS[6]  the semaphore's waiter queue
-- KEYS[7]  the semaphore's number of permits
-- KEYS[8]  the read-write lock's writer (rw_acquire.lua)
-- KEYS[9]  its readers
-- KEYS[10] the readers' fencing tokens and owner records
-- KEYS[11] the read-write lock's waiter queue
-- KEYS[12] the semaphore holders' weights
--
-- returns  one entry per kind held, each {kind, holders, ms left (-1: no expiry), fencing
--          token (-1: none), waiters, permits (-1: not set, or not a semaphore), held by}:
--          "lock", or "fair" for a fair lock (its hash holds "#fair", see acquire.lua; one
--          written before that field was: while the fair queue holds waiters); for
--          a semaphore or the readers, the live holders (expired ones are not counted), the
--          ms until the last of their leases ends and the largest of their fencing tokens;
--          "write" for the writer. "held by" lists the holders, each {owner token, owner
--          record ("" for none: a hold written without one, or before records were kept),
--          ms left (-1: no expiry), its fencing token (-1: none), its weight (permits held;
--          1 but for a semaphore)}. A value of another type at a holder key (not written by
--          lockaspect) counts as one holder without a fencing token, and is not listed.
-- include: lib.lua
-- include: holds.lua
local now = server_ms()

local function llen(queue)
  return read('LLEN', queue) or 0
end

local function left(key)
  local pttl = redis.call('PTTL', key)
  return pttl < 0 and -1 or pttl
end

-- HMGET of `fields` from `hash`, in chunks (unpack has a limit); {} for a hash that is not
-- one (another type) or not given
local function hmget_all(hash, fields)
  local values = {}
  if not hash then
    return values
  end
  for i = 1, #fields, 1000 do
    local chunk = read('HMGET', hash, unpack(fields, i, math.min(i + 999, #fields))) or {}
    for j = 1, math.min(1000, #fields - i + 1) do
      values[i + j - 1] = chunk[j]
    end
  end
  return values
end

-- a hash {<owner field> = <owner record> (1: none), "fence" = fencing token} with the lease
-- as its TTL; a fair lock's also holds "#fair"
local function hash_entry(kind, key, waiters)
  local kind_of = redis.call('TYPE', key)['ok']
  if kind_of == 'none' then
    return nil
  end
  local ms = left(key)
  if kind_of ~= 'hash' then
    return {kind, 1, ms, -1, waiters, -1, {}}
  end
  local fields = redis.call('HGETALL', key)
  local fence = -1
  for i = 1, #fields, 2 do
    if fields[i] == 'fence' then
      fence = tonumber(fields[i + 1]) or -1
    elseif fields[i] == '#fair' then
      kind = 'fair'
    end
  end
  local held_by = {}
  for i = 1, #fields, 2 do
    if fields[i] ~= 'fence' and fields[i] ~= '#fair' then
      local record = fields[i + 1]
      if record == '1' then
        record = ''
      end
      held_by[#held_by + 1] = {field_owner(fields[i]), record, ms, fence, 1}
    end
  end
  return {kind, #held_by, ms, fence, waiters, -1, held_by}
end

-- a sorted set {<owner token> = server ms when its lease ends}, with its fences and owner
-- records (holds.lua's share_value) and weights by owner token
local function zset_entry(kind, key, fences, weights, waiters, permits)
  local kind_of = redis.call('TYPE', key)['ok']
  if kind_of == 'none' then
    return nil
  end
  if kind_of ~= 'zset' then
    return {kind, 1, left(key), -1, waiters, permits, {}}
  end
  local live = redis.call('ZRANGEBYSCORE', key, '(' .. now, '+inf', 'WITHSCORES')
  if #live == 0 then
    return nil
  end
  local tokens = {}
  for i = 1, #live, 2 do
    tokens[#tokens + 1] = live[i]
  end
  local share_of, weight_of = hmget_all(fences, tokens), hmget_all(weights, tokens)
  local fence, held_by = -1, {}
  for i, token in ipairs(tokens) do
    local share = share_of[i]
    local own = share_fence(share) or -1
    if own > fence then
      fence = own
    end
    held_by[i] = {token, share_record(share), tonumber(live[2 * i]) - now, own, tonumber(weight_of[i]) or 1}
  end
  return {kind, #tokens, tonumber(live[#live]) - now, fence, waiters, permits, held_by}
end

local states = {}
local function add(entry)
  if entry then
    states[#states + 1] = entry
  end
end

local fair_waiters = llen(KEYS[3])
add(hash_entry(fair_waiters > 0 and 'fair' or 'lock', KEYS[1], llen(KEYS[2]) + fair_waiters))
local permits = tonumber(read('GET', KEYS[7])) or -1
add(zset_entry('semaphore', KEYS[4], KEYS[5], KEYS[12], llen(KEYS[6]), permits))
local rw_waiters = llen(KEYS[11])
add(hash_entry('write', KEYS[8], rw_waiters))
add(zset_entry('read', KEYS[9], KEYS[10], nil, rw_waiters, -1))
return states
