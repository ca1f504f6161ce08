-- sem_reenter.lua: whether a semaphore permit is still held (a nested call re-entering it;
-- re-entry holds are counted by the client, the store keeps one permit per owner).
--
-- KEYS[1]  the holders (see sem_acquire.lua; a value of another type is not ours)
-- ARGV[1]  owner token
--
-- returns  1  still held (its lease has not ended); 0 not held any more
-- include: lib.lua
local now = server_ms()
local expires = read('ZSCORE', KEYS[1], ARGV[1])
if expires and tonumber(expires) > now then
  return 1
end
return 0
