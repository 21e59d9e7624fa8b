-- Peek: one tier's numbers for one key, without charging anything (the
-- twin of Limit::check in src/algorithm/mod.rs). Joined after dispatch.lua
-- instead of check.lua, and run with EVALSHA_RO where Redis has it (7.0+):
-- an algorithm only returns its write (a value to SET, or a function), and
-- this script applies none; the one algorithm that writes while deciding,
-- the penalty box, does so only after its tier denied in the same call,
-- which a peek of one tier never has. The algorithm is called without the
-- short flag: a bucket answers the long form.
--
-- KEYS[1]   the key (on a cluster, "{<key>}", as the check writes it)
-- ARGV[1]   the clock, as ARGV[1] of check.lua ("" = Redis TIME, or a test
--           clock "<now µs>[:<ttl slack ms>]")
-- ARGV[2]   the tier's spec, as in check.lua ("<algorithm> <p1> <p2> <p3>
--           <p4> <cost> <flags>"; the flags are ignored)
-- Returns   the check reply of one tier (src/backend/redis/wire/mod.rs):
--           { now_us, r, reset_after_us, w } and, when an allowing tier
--           would delay the request (shaping leaky bucket), the trailer
--           entry { 1, delay_us, 0 }. An allowing tier's w is 0.

local now = read_clock(ARGV[1])
local states = read_states(1)
local t = tier_spec(ARGV[2])
if not t then
  return redis.error_reply('bad tier spec ' .. tostring(ARGV[2]))
end
-- The algorithm only reads: its write (a value, or a function) is dropped.
local allowed, remaining, reset, retry, delay =
  t[1](KEYS[1], now, t[2], t[3], t[4], t[5], t[6], states[1], false, t[14])
if allowed == 1 then
  if delay > 0 then return { now, remaining, reset, 0, 1, delay, 0 } end
  return { now, remaining, reset, 0 }
end
return { now, -remaining - 1, reset, retry }
