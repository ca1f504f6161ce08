-- lib.lua: helpers for the scripts that name it in a line "-- include: lib.lua" (the loader
-- puts this text there, so each script's SHA covers the helpers it runs).

-- The server's clock in milliseconds: leases and waiters are judged by it, never by clients'.
local function server_ms()
  local time = redis.call('TIME')
  return time[1] * 1000 + math.floor(time[2] / 1000)
end

-- The next fencing token of `counter` (INCR). A counter that does not exist yet, or that
-- the store lost (a restart without persistence, an eviction), starts from the server
-- clock in microseconds: above every token the lost counter issued, since a counter gains
-- one per acquisition, far less than one per microsecond.
local function next_fence(counter)
  local fence = redis.call('INCR', counter)
  if fence == 1 then
    local time = redis.call('TIME')
    local start = time[1] .. string.format('%06d', tonumber(time[2]))
    redis.call('SET', counter, start)
    fence = tonumber(start)
  end
  return fence
end

-- HDEL `fields` from `hash` in chunks (unpack has a limit: a mass expiry can leave thousands).
local function hdel_all(hash, fields)
  for i = 1, #fields, 1000 do
    redis.call('HDEL', hash, unpack(fields, i, math.min(i + 999, #fields)))
  end
end

-- Pop waiter ids from `queue` and wake each with a message on `prefix` .. ':wake:' .. id,
-- at most `limit` of them; with `one`, stop at the first one somebody received (a waiter
-- whose process is gone is skipped). pcall: a server user without pub/sub rights still
-- releases; its waiters poll instead.
local function wake(queue, prefix, limit, one)
  for _ = 1, limit do
    local waiter = redis.call('LPOP', queue)
    if not waiter then
      return
    end
    local received = redis.pcall('PUBLISH', prefix .. ':wake:' .. waiter, 'released')
    if one and (type(received) ~= 'number' or received > 0) then
      return
    end
  end
end
