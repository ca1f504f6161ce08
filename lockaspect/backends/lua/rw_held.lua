-- rw_held.lua: whether a read or write hold of a read-write lock is still held (a nested
-- call re-entering it; re-entry holds are counted by the client).
--
-- KEYS[1]  the writer (see rw_acquire.lua)
-- KEYS[2]  the readers
-- ARGV[1]  owner token
-- ARGV[2]  "read" or "write"
--
-- returns  1  still held (its lease has not ended); 0 not held any more
if ARGV[2] == 'write' then
  return redis.call('HEXISTS', KEYS[1], ARGV[1])
end
-- include: lib.lua
local now = server_ms()
local expires = redis.call('ZSCORE', KEYS[2], ARGV[1])
if expires and tonumber(expires) > now then
  return 1
end
return 0
