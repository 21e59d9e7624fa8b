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
--           shadow (1 = the tier is in shadow mode: its denial does not stop
--           the other tiers from being charged)
-- KEYS[n+1] optional: the hourly sorted set of rejected keys (fleet-wide
--           top-N): every tier that rejects adds its cost to its key's
--           score; the set keeps its 10 000 heaviest keys and lives 25 h.
-- Returns   { now_us, then per tier: allowed (0/1), remaining,
--             reset_after_us, retry_after_us, delay_us, undo }
--           where undo is what the tier's charge returned (0 if it was not
--           charged, or its algorithm returns nothing): the argument of its
--           refund (lua/refund.lua, run through lua/cluster.lua's 'refund'
--           mode for skip_failed_requests / skip_successful_requests).
-- Writes happen only if every enforced tier allows the request; then every
-- tier that allows it is charged (a shadow tier that would deny is not, just
-- as an enforced denial charges nothing).

local now, deadline = read_clock(ARGV[1])
if deadline and now > deadline then
  return { now, -1 }
end

local out = { now }
local commits = {}
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
  out[#out + 1] = allowed
  out[#out + 1] = remaining
  out[#out + 1] = reset
  out[#out + 1] = retry
  out[#out + 1] = delay
  out[#out + 1] = 0
  if allowed == 1 then
    commits[#commits + 1] = { commit, #out }
  else
    rejected[#rejected + 1] = i
    if not shadow then all = false end
  end
end

if all then
  for _, c in ipairs(commits) do
    out[c[2]] = c[1]() or 0
  end
end
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
