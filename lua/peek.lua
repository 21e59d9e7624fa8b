-- Peek: one tier's numbers for one key, without charging anything (the
-- twin of Limit::check in src/algorithm/mod.rs). Joined after dispatch.lua
-- instead of check.lua, and run with EVALSHA_RO where Redis has it (7.0+):
-- the algorithms only read until their commit function runs, and this
-- script never runs one.
--
-- KEYS[1]   the key (on a cluster, "{<key>}", as the check writes it)
-- ARGV[1]   the clock, as ARGV[1] of check.lua ("" = Redis TIME, or a test
--           clock "<now µs>[:<ttl slack ms>]")
-- ARGV[2..8] the tier's seven arguments, as in check.lua (algorithm,
--           p1..p4, cost, flags; the flags are ignored)
-- Returns   the check reply of one tier (src/backend/redis/wire/mod.rs):
--           { now_us, r, reset_after_us, w } and, when an allowing tier
--           would delay the request (shaping leaky bucket), the trailer
--           entry { 1, delay_us, 0 }. An allowing tier's w is 0.

local now = read_clock(ARGV[1])
local states = read_states(1)
local allowed, remaining, reset, retry, delay = check_tier(KEYS[1], now, 2, states[1])
if allowed == false then
  return redis.error_reply('unknown algorithm ' .. tostring(ARGV[2]))
end
if allowed == 1 then
  if delay > 0 then return { now, remaining, reset, 0, 1, delay, 0 } end
  return { now, remaining, reset, 0 }
end
return { now, -remaining - 1, reset, retry }
