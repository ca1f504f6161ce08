-- sem_renew.lua: extend many semaphore holds (or read holds) in one call, each only if still
-- held.
--
-- KEYS[3i-2]  the holders of a semaphore (see sem_acquire.lua), or a read-write lock's
--             readers (rw_acquire.lua); a value of another type is not ours
-- KEYS[3i-1]  their fencing tokens and owner records
-- KEYS[3i]    their weights (a read-write lock: a key that never exists, readers hold one)
-- ARGV[2i-1]  owner token
-- ARGV[2i]    new lease in milliseconds
--
-- returns     {s1, ..., sN} with si = 1 renewed, 0 not held any more (expired or released)
-- The three keys of a semaphore live as long as its longest hold (sem_acquire.lua): each is
-- extended to the longest new lease of its semaphore when shorter (on its own: one that a
-- client of an older version left behind may be shorter than the holders).
-- Everything is read before the first write (lib.lua): a failing command leaves nothing.
-- include: lib.lua
local now = server_ms()
local result = {}
local n = #ARGV / 2
for i = 1, n do
  local expires = read('ZSCORE', KEYS[3 * i - 2], ARGV[2 * i - 1])
  if expires and tonumber(expires) > now then
    result[i] = 1
  else
    result[i] = 0
  end
end
-- the longest new lease of each semaphore, and each of its keys' PTTL
local longest, pttl = {}, {}
for i = 1, n do
  if result[i] == 1 then
    local holders = KEYS[3 * i - 2]
    longest[holders] = math.max(longest[holders] or 0, tonumber(ARGV[2 * i]))
    for j = 3 * i - 2, 3 * i do
      if not pttl[KEYS[j]] then
        pttl[KEYS[j]] = redis.call('PTTL', KEYS[j])
      end
    end
  end
end
-- writes from here on
for i = 1, n do
  if result[i] == 1 then
    redis.call('ZADD', KEYS[3 * i - 2], 'XX', now + tonumber(ARGV[2 * i]), ARGV[2 * i - 1])
    local ms = longest[KEYS[3 * i - 2]]
    for j = 3 * i - 2, 3 * i do
      local key = KEYS[j]
      if pttl[key] ~= -2 and pttl[key] < ms then
        redis.call('PEXPIRE', key, ms)
        pttl[key] = ms
      end
    end
  end
end
return result
