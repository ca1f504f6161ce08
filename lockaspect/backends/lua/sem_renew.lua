-- sem_renew.lua: extend many semaphore permits in one call, each only if still held.
--
-- KEYS[2i-1]  the holders of a semaphore (see sem_acquire.lua)
-- KEYS[2i]    the holders' fencing tokens of that semaphore
-- ARGV[2i-1]  owner token
-- ARGV[2i]    new lease in milliseconds
--
-- returns     {s1, ..., sN} with si = 1 renewed, 0 not held any more (expired or released)
-- include: lib.lua
local now = server_ms()
local result = {}
for i = 1, #ARGV / 2 do
  local holders, fences, token = KEYS[2 * i - 1], KEYS[2 * i], ARGV[2 * i - 1]
  local ms = tonumber(ARGV[2 * i])
  local expires = redis.call('ZSCORE', holders, token)
  if expires and tonumber(expires) > now then
    redis.call('ZADD', holders, 'XX', now + ms, token)
    if redis.call('PTTL', holders) < ms then
      redis.call('PEXPIRE', holders, ms)
      redis.call('PEXPIRE', fences, ms)
    end
    result[i] = 1
  else
    result[i] = 0
  end
end
return result
