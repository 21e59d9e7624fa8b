-- Every tier of one request, all or nothing, in one script call.
--
-- KEYS[i]   the key of tier i: "<prefix>:<tier>:<key part>"
-- ARGV[1]   "" to read the clock with Redis TIME (production);
--           "d<deadline µs>": Redis TIME, and if it is past the deadline the
--           app has already given up on this check: write nothing, return
--           { now_us, -1 } ("late");
--           or a test clock in Unix epoch microseconds (ManualClock; tests
--           only), optionally followed by ":<ttl slack ms>" (see common.lua)
-- ARGV[2 + 7(i-1) ..], seven per tier:
--           algorithm (1 fixed_window, 2 sliding_window_log,
--           3 sliding_window_counter, 4 token_bucket, 5 leaky_bucket),
--           p1, p2, p3, p4 (the algorithm's parameters, see each file), cost,
--           flags: +1 shadow (the tier is in shadow mode: its denial does
--           not stop the other tiers from being charged), +2 undo (return
--           the charge's undo value, for a refund by response status)
-- KEYS[n+1] optional: the hourly sorted set of rejected keys (fleet-wide
--           top-N): every tier that rejects adds its cost to its key's
--           score; the set keeps its 10 000 heaviest keys and lives 25 h.
-- Returns   { now_us, then three per tier: r, reset_after_us, w;
--             then a trailer of three per tier that needs one: i, delay_us,
--             undo }
--           r = remaining when the tier allows, -(remaining + 1) when it
--           denies; w = its retry_after_us when it denies, and when it
--           allows the wait before another request of the same cost would
--           pass (see dispatch.lua). The trailer lists, by tier number i
--           (1-based), every allowing tier with a delay (shaping) or, when
--           the request was charged and the tier's undo flag is set, a
--           non-zero undo: what its charge returned, the argument of its
--           refund (lua/refund.lua, through lua/cluster.lua's 'refund'
--           mode). Every other delay and undo is 0. (Few numbers: the client
--           parses each one, about 1 000 instructions apiece in redis-rs.)
-- Writes happen only if every enforced tier allows the request; then every
-- tier that allows it is charged (a shadow tier that would deny is not, just
-- as an enforced denial charges nothing).

local now, deadline = read_clock(ARGV[1])
if deadline and now > deadline then
  return { now, -1 }
end

local out = { now }
local commits = {}
local trailer = {}
local all = true
local tiers = (#ARGV - 1) / 7
local rejected = {}
local states = read_states(tiers)
for i = 1, tiers do
  local a = 2 + (i - 1) * 7
  local allowed, remaining, reset, retry, delay, commit, shadow = check_tier(KEYS[i], now, a, states[i])
  if allowed == false then
    return redis.error_reply('unknown algorithm ' .. tostring(ARGV[a]))
  end
  if allowed == 1 then
    out[#out + 1] = remaining
    commits[#commits + 1] = { commit, i, delay, tonumber(ARGV[a + 6]) >= 2 }
  else
    out[#out + 1] = -remaining - 1
    rejected[#rejected + 1] = i
    if not shadow then all = false end
  end
  out[#out + 1] = reset
  out[#out + 1] = retry
end

for _, c in ipairs(commits) do
  local undo = 0
  if all then undo = c[1]() or 0 end
  if not c[4] then undo = 0 end
  if c[3] > 0 or undo ~= 0 then
    trailer[#trailer + 1] = c[2]
    trailer[#trailer + 1] = c[3]
    trailer[#trailer + 1] = undo
  end
end
for _, v in ipairs(trailer) do out[#out + 1] = v end

local blocked = KEYS[tiers + 1]
if blocked and #rejected > 0 then
  for _, i in ipairs(rejected) do
    redis.call('ZINCRBY', blocked, tonumber(ARGV[2 + (i - 1) * 7 + 5]), KEYS[i])
  end
  local extra = redis.call('ZCARD', blocked) - 10000
  if extra > 0 then redis.call('ZREMRANGEBYRANK', blocked, 0, extra - 1) end
  redis.call('EXPIRE', blocked, 90000)
end
return out
