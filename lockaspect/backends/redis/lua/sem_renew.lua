-- sem_renew.lua: extend many semaphore permits in one call, each only if still held.
--
-- KEYS[2i-1]  the holders of a semaphore (see sem_acquire.lua; a value of another type is
--             not ours)
-- KEYS[2i]    the holders' fencing tokens of that semaphore
-- ARGV[2i-1]  owner token
-- ARGV[2i]    new lease in milliseconds
--
-- returns     {s1, ..., sN} with si = 1 renewed, 0 not held any more (expired or released)
-- Everything is read before the first write (lib.lua): a failing command leaves nothing.
-- include: lib.lua
local now = server_ms()
local result = {}
local n = #ARGV / 2
for i = 1, n do
  local expires = read('ZSCORE', KEYS[2 * i - 1], ARGV[2 * i - 1])
  if expires and tonumber(expires) > now then
    result[i] = 1
  else
    result[i] = 0
  end
end
-- the holders' keys live as long as their longest permit: the longest new lease of each
local longest, pttl = {}, {}
for i = 1, n do
  local holders = KEYS[2 * i - 1]
  if result[i] == 1 then
    if not pttl[holders] then
      pttl[holders] = redis.call('PTTL', holders)
    end
    longest[holders] = math.max(longest[holders] or 0, tonumber(ARGV[2 * i]))
  end
end
-- writes from here on
for i = 1, n do
  local holders, token = KEYS[2 * i - 1], ARGV[2 * i - 1]
  if result[i] == 1 then
    redis.call('ZADD', holders, 'XX', now + tonumber(ARGV[2 * i]), token)
    local ms = longest[holders]
    if ms and pttl[holders] < ms then
      redis.call('PEXPIRE', holders, ms)
      redis.call('PEXPIRE', KEYS[2 * i], ms)
      longest[holders] = nil
    end
  end
end
return result
