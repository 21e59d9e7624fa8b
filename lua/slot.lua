-- Renews one concurrency slot (src/engine/slots.rs): a request still
-- running after half its TTL moves its expiry to now + ttl_us, if the
-- slot is still held (not released, not expired). Joined after
-- dispatch.lua (for read_clock), instead of check.lua.
--
-- KEYS[1]   the tier's sorted set of slots (on a cluster "{<key>}")
-- ARGV[1]   the clock, as ARGV[1] of check.lua
-- ARGV[2]   the slot id
-- ARGV[3]   ttl_us
-- Returns   1 when renewed, 0 when the slot is gone.

local now = read_clock(ARGV[1])
local ttl_us = tonumber(ARGV[3])
local score = redis.pcall('ZSCORE', KEYS[1], ARGV[2])
if type(score) ~= 'string' or tonumber(score) <= now then return 0 end
rcall('ZADD', KEYS[1], 'XX', int(now + ttl_us), ARGV[2])
if rcall('PTTL', KEYS[1]) < ttl_ms(ttl_us) then
  rcall('PEXPIRE', KEYS[1], ttl_ms(ttl_us))
end
return 1
