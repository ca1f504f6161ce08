-- renew.lua: extend many leases in one call, each only if its token still owns it.
--
-- KEYS[1..N]  lock hashes (see acquire.lua: owner fields; a value of another type is not
--             ours); they may span hash slots only on a server that is not a cluster member
--             (a cluster client must batch per slot)
-- ARGV[2i-1]  owner token of KEYS[i]
-- ARGV[2i]    new lease of KEYS[i] in milliseconds
--
-- returns     {s1, ..., sN} with si = 1 renewed, 0 not ours any more (gone, another owner,
--             or a value of another type written over the lock)
-- All ownership checks come before the first PEXPIRE (lib.lua).
-- include: lib.lua
local result = {}
for i = 1, #KEYS do
  if read('HEXISTS', KEYS[i], owner_field(ARGV[2 * i - 1])) == 1 then
    result[i] = 1
  else
    result[i] = 0
  end
end
for i = 1, #KEYS do
  if result[i] == 1 then
    redis.call('PEXPIRE', KEYS[i], ARGV[2 * i])
  end
end
return result
