-- Renews one concurrency lease (src/engine/slots.rs): a request still
-- running after half its lease moves its expiry to now + lease_us, if the
-- lease is still held (not released, not expired). Joined after
-- dispatch.lua (for read_clock), instead of check.lua.
--
-- KEYS[1]   the tier's sorted set of leases (on a cluster "{<key>}")
-- ARGV[1]   the clock, as ARGV[1] of check.lua
-- ARGV[2]   the lease id
-- ARGV[3]   lease_us
-- Returns   1 when renewed, 0 when the lease is gone.

local now = read_clock(ARGV[1])
local lease_us = tonumber(ARGV[3])
local score = redis.pcall('ZSCORE', KEYS[1], ARGV[2])
if type(score) ~= 'string' or tonumber(score) <= now then return 0 end
redis.call('ZADD', KEYS[1], 'XX', int(now + lease_us), ARGV[2])
if redis.call('PTTL', KEYS[1]) < ttl_ms(lease_us) then
  redis.call('PEXPIRE', KEYS[1], ttl_ms(lease_us))
end
return 1
