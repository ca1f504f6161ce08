-- fenced_write.lua: write a value only for a fencing token no older than any seen before.
--
-- KEYS[1]  the protected resource (a string key)
-- KEYS[2]  the resource's high-water mark: the largest fencing token that wrote it
-- ARGV[1]  the writer's fencing token (a decimal integer)
-- ARGV[2]  the value to store in KEYS[1]
--
-- returns  {1, token}  written; the high-water mark is now ARGV[1]
--          {0, high}   rejected: a newer holder (fencing token `high`) already wrote
--
-- Equal tokens pass, so one holder may write several times during one lease.
local token = tonumber(ARGV[1])
local high = tonumber(redis.call('GET', KEYS[2]) or '-1')
if token < high then
  return {0, high}
end
redis.call('SET', KEYS[2], ARGV[1])
redis.call('SET', KEYS[1], ARGV[2])
return {1, token}
