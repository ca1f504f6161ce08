-- reenter.lua: whether an owner still holds the lock (a nested call re-entering it). Read
-- only: re-entries are counted by the client, the store keeps one hold per owner, so a
-- re-entry whose reply is lost or comes late changes nothing here.
--
-- KEYS[1]  the lock hash (see acquire.lua: owner fields; a value of another type is not ours)
-- ARGV[1]  owner token
--
-- returns  1  the token holds the lock (the lease is unchanged)
--          0  the token holds nothing: the lease is gone or someone else has it
-- include: lib.lua
if read('HEXISTS', KEYS[1], owner_field(ARGV[1])) ~= 1 then
  return 0
end
return 1
