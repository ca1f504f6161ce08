-- holds.lua: helpers for the scripts that keep owner records and semaphore weights, for
-- those that name it in a line "-- include: holds.lua" after lib.lua's (the loader puts this
-- text there). Apart from lib.lua so that the lock's hot path (acquire.lua, release.lua)
-- does not build closures it never calls.

-- What an owner field of a lock (or a read-write lock's writer) holds: the owner record sent
-- with the acquisition (AcquireRequest.owner: a JSON object, opaque here), or 1 when it sent
-- none, as every hold written before owner records were kept holds. Scripts only ask whether
-- the field exists (HEXISTS, HLEN, HGET's truthiness), never what it holds, so both work;
-- describe.lua reports 1 as no record (''). acquire.lua and multi_acquire.lua write the
-- same inline.
local function owner_value(record)
  if not record or record == '' then
    return 1
  end
  return record
end

-- The token an owner field stands for (owner_field's inverse).
local function field_owner(field)
  if string.byte(field, 1) == 35 then
    return string.sub(field, 2)
  end
  return field
end

-- A semaphore holder's or a reader's entry in its fences hash: its fencing token, then its
-- owner record after a space when it sent one ("<fence>" or "<fence> <record>"; entries
-- written before records were kept hold the fence alone). The record thus shares the
-- entry's TTL and goes wherever the entry goes. share_fence and share_record read an entry
-- (false, or nil: none).
local function share_value(fence, record)
  if record and record ~= '' then
    return string.format('%.0f', fence) .. ' ' .. record
  end
  return fence
end

local function share_fence(value)
  return value and tonumber(string.match(value, '^%d+'))
end

local function share_record(value)
  return value and string.match(value, '^%d+ (.*)$') or ''
end

-- The permits in use of a semaphore: the sum of its live holders' weights. `holders` is its
-- sorted set {<owner token> = server ms when the hold ends}, `weights` its hash {<owner
-- token> = permits held} of the holders of more than one permit (the others hold one).
-- Also returns the tokens of `weights` whose hold ended or is gone (for HDEL), in a table
-- that may be empty.
local function sem_in_use(holders, weights, now)
  local in_use = redis.call('ZCOUNT', holders, '(' .. now, '+inf')
  local weighted = redis.call('HGETALL', weights)
  local dead = {}
  for i = 1, #weighted, 2 do
    local ends = tonumber(redis.call('ZSCORE', holders, weighted[i]))
    if ends and ends > now then
      in_use = in_use + (tonumber(weighted[i + 1]) or 1) - 1
    else
      dead[#dead + 1] = weighted[i]
    end
  end
  return in_use, dead
end
