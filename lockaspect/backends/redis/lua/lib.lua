-- lib.lua: helpers for the scripts that name it in a line "-- include: lib.lua" (the loader
-- puts this text there, so each script's SHA covers the helpers it runs). Scripts include it
-- before their first command.
--
-- Every script reads before it writes: each command that can fail (TIME for a server user
-- without +time, a command on a key holding another type, a write refused for memory) runs
-- before the first write, or is that first write. A script that fails leaves nothing behind.
--
-- Wake-ups are published with 'PUBLISH'; a Redis Cluster store loads every script with
-- 'SPUBLISH' in its place (sharded pub/sub: the channel shares the lock's hash tag, so it is
-- in the slot of the script's keys, and only that slot's primary delivers it).

-- Redis 6.2 with "lua-replicate-commands no" replicates a script verbatim and then refuses a
-- write after TIME; effects replication (this call, made before any write) lifts that. From
-- Redis 7 on, and on Valkey, it is always on and the call is a no-op returning true; a server
-- without the function skips it.
if redis.replicate_commands then
  redis.replicate_commands()
end

-- The server's clock in milliseconds: leases and waiters are judged by it, never by clients'.
local function server_ms()
  local time = redis.call('TIME')
  return time[1] * 1000 + math.floor(time[2] / 1000)
end

-- A read command (redis.call's arguments) on a key that may hold a value lockaspect did not
-- write there (a foreign SET into the namespace): its reply, or nil and true when the key
-- holds another type (WRONGTYPE). A value of another type is never ours: the scripts treat
-- it as another owner's. Any other error is raised as redis.call raises it (by calling
-- again: a read, so asking twice changes nothing).
local function read(...)
  local reply = redis.pcall(...)
  if type(reply) == 'table' and reply.err then
    if string.find(reply.err, 'WRONGTYPE', 1, true) == 1 then
      return nil, true
    end
    return redis.call(...)
  end
  return reply
end

-- The field of owner `token` in a hash that also holds the field "fence" (a lock, a
-- read-write lock's writer). Tokens are stored as they are, except "fence" and tokens that
-- start with "#", which get a "#" in front: "fence" -> "#fence", "#x" -> "##x". A field that
-- starts with "#" thus comes from the second rule and any other from the first, so two
-- tokens never share a field and no token's field is "fence": whatever a caller passes as
-- its token, it can neither read nor write the fencing token as if it were an owner. Nor is
-- any token's field "#fair" (that would be the token "fair", which is not escaped): a fair
-- lock's hash holds that field, so describe.lua can tell it from a lock.
local function owner_field(token)
  if token == 'fence' or string.byte(token, 1) == 35 then
    return '#' .. token
  end
  return token
end

-- The next fencing token of `counter`, in two steps so that it can be read before a script
-- writes: fence_read(counter) only reads (GET, and TIME for a counter that does not exist
-- yet) and returns what fence_write(counter, seed) then writes (INCR, or SET to the seed),
-- which cannot fail once fence_read succeeded. A counter that does not exist yet, or that
-- the store lost (a restart without persistence, an eviction) or that holds anything but a
-- positive count, starts from the server clock in microseconds: above every token the lost
-- counter issued, since a counter gains one per acquisition, far less than one per us.
local function fence_read(counter)
  local current = redis.call('GET', counter)
  if current and #current <= 17 and string.find(current, '^[1-9]%d*$') then
    return nil
  end
  local time = redis.call('TIME')
  return time[1] .. string.format('%06d', tonumber(time[2]))
end

local function fence_write(counter, seed)
  if seed then
    redis.call('SET', counter, seed)
    return tonumber(seed)
  end
  return redis.call('INCR', counter)
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
-- releases; its waiters poll instead. The first LPOP fails on a queue of another type:
-- scripts call wake before their other writes, or read the queue first.
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
