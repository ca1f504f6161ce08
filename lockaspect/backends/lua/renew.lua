-- renew.lua: extend many leases in one call, each only if its token still owns it.
--
-- KEYS[1..N]  lock hashes (see acquire.lua); they may span hash slots only on a server that
--             is not a cluster member (a cluster client must batch per slot)
-- ARGV[2i-1]  owner token of KEYS[i]
-- ARGV[2i]    new lease of KEYS[i] in milliseconds
--
-- returns     {s1, ..., sN} with si = 1 renewed, 0 not ours any more (gone or another owner)
local result = {}
for i = 1, #KEYS do
  if redis.call('HEXISTS', KEYS[i], ARGV[2 * i - 1]) == 1 then
    redis.call('PEXPIRE', KEYS[i], ARGV[2 * i])
    result[i] = 1
  else
    result[i] = 0
  end
end
return result
