-- acl_check.lua: which commands the connecting user may run, asked of the server itself
-- (redis.acl_check_cmd, Redis 7.0+ and Valkey), for `lockaspect doctor`. Runs nothing it
-- checks and writes nothing.
--
-- KEYS: none (the checked commands' keys are in ARGV: the check does not touch them).
-- ARGV: a flat list of calls, each its argument count then its arguments:
--       2, 'GET', 'ns:{doctor}', 4, 'HSET', 'ns:{doctor}', '0', '0', ...
-- Returns: one reply per call, in order: 1 allowed, 0 refused, or the error's text (an
-- unknown command, or no acl_check_cmd at all on Redis 6).
local out = {}
local i = 1
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  local call = {}
  for j = 1, n do
    call[j] = ARGV[i + j]
  end
  local ok, allowed = pcall(function() return redis.acl_check_cmd(unpack(call)) end)
  if not ok then
    out[#out + 1] = tostring(type(allowed) == 'table' and allowed.err or allowed)
  elseif allowed then
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
  i = i + n + 1
end
return out
