-- rw_held.lua: whether a read or write hold of a read-write lock is still held (a nested
-- call re-entering it; re-entry holds are counted by the client).
--
-- KEYS[1]  the writer (see rw_acquire.lua: owner fields; a value of another type is not ours)
-- KEYS[2]  the readers (a value of another type is not ours)
-- ARGV[1]  owner token
-- ARGV[2]  "read" or "write"
--
-- returns  1  still held (its lease has not ended); 0 not held any more
-- include: lib.lua
if ARGV[2] == 'write' then
  return read('HEXISTS', KEYS[1], owner_field(ARGV[1])) or 0
end
local now = server_ms()
local expires = read('ZSCORE', KEYS[2], ARGV[1])
if expires and tonumber(expires) > now then
  return 1
end
return 0
