-- held.lua: which of the given holder keys hold something now (AdminStore.held_keys, for
-- the keys a SCAN found). Reads only.
--
-- KEYS     holder keys: locks and writers (hashes that expire with their lease), semaphore
--          holders and readers (sorted sets by lease end, whose expired members stay until
--          the next acquisition drops them)
--
-- returns  one flag per key: 1 held (a hash, a sorted set with a live member, a value of
--          another type: not written by lockaspect, another owner's), 0 not (gone, expired)
-- include: lib.lua
local now = server_ms()
local held = {}
for i, key in ipairs(KEYS) do
  local kind_of = redis.call('TYPE', key)['ok']
  if kind_of == 'none' then
    held[i] = 0
  elseif kind_of == 'zset' then
    held[i] = redis.call('ZCOUNT', key, '(' .. now, '+inf') > 0 and 1 or 0
  else
    held[i] = 1
  end
end
return held
