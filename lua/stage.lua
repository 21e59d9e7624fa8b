-- A running plan's stage counted fleet-wide (src/engine/rollout/gates.rs):
-- each instance's checks since its last poll added to the stage's totals,
-- its map of keys seen OR-ed into the stage's map; answers the totals, so
-- the leader's gates read the fleet's stage. A function of lua/poll.lua
-- (`stage_part`), a part of the instance's one call a poll.
--
-- KEYS[1]  the stage's totals, a hash {<control>}:stage:<tier>:<since_us>
-- KEYS[2]  the stage's map of keys seen (a 64 Kbit string), same prefix
-- KEYS[3]  this instance's scratch key for its map, same prefix
-- ARGV[1]  checks since the last poll
-- ARGV[2]  of those, in the enforced cohort
-- ARGV[3]  this instance's map of keys seen in the stage ("" : unchanged)
-- ARGV[4]  the keys' lifetime, in s
--
-- Answers {checks, enforced, bits set in the stage's map}.

local r = tonumber(ARGV[1])
local e = tonumber(ARGV[2])
if r > 0 then redis.call('HINCRBY', KEYS[1], 'requests', r) end
if e > 0 then redis.call('HINCRBY', KEYS[1], 'enforced', e) end
if ARGV[3] ~= '' then
  redis.call('SET', KEYS[3], ARGV[3])
  redis.call('BITOP', 'OR', KEYS[2], KEYS[2], KEYS[3])
  redis.call('DEL', KEYS[3])
  redis.call('EXPIRE', KEYS[2], tonumber(ARGV[4]))
end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
local t = redis.call('HMGET', KEYS[1], 'requests', 'enforced')
return {tonumber(t[1]) or 0, tonumber(t[2]) or 0, redis.call('BITCOUNT', KEYS[2])}
