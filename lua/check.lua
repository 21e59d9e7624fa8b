-- Every tier of one request, all or nothing, in one script call.
--
-- KEYS[i]   the key of tier i: "<prefix>:<tier>:<key part>"
-- ARGV[1]   "" to read the clock with Redis TIME (production), or a test
--           clock in Unix epoch microseconds (ManualClock; tests only),
--           optionally followed by ":<ttl slack ms>" (see common.lua)
-- ARGV[2 + 7(i-1) ..], seven per tier:
--           algorithm (1 fixed_window, 2 sliding_window_log,
--           3 sliding_window_counter, 4 token_bucket, 5 leaky_bucket),
--           p1, p2, p3, p4 (the algorithm's parameters, see each file), cost,
--           shadow (1 = the tier is in shadow mode: its denial does not stop
--           the other tiers from being charged)
-- Returns   { now_us, then per tier: allowed (0/1), remaining,
--             reset_after_us, retry_after_us, delay_us }
-- Writes happen only if every enforced tier allows the request; then every
-- tier that allows it is charged (a shadow tier that would deny is not, just
-- as an enforced denial charges nothing).

local algorithms = {
  fixed_window, sliding_window_log, sliding_window_counter, token_bucket, leaky_bucket,
}

local now
if ARGV[1] ~= '' then
  local clock, slack = string.match(ARGV[1], '^(%d+):?(%d*)$')
  now = tonumber(clock)
  if slack ~= nil and slack ~= '' then ttl_slack_ms = tonumber(slack) end
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local out = { now }
local commits = {}
local all = true
for i = 1, #KEYS do
  local a = 2 + (i - 1) * 7
  local algorithm = algorithms[tonumber(ARGV[a])]
  if not algorithm then
    return redis.error_reply('unknown algorithm ' .. tostring(ARGV[a]))
  end
  local allowed, remaining, reset, retry, delay, commit = algorithm(
    KEYS[i], now,
    tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]),
    tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]))
  out[#out + 1] = allowed
  out[#out + 1] = remaining
  out[#out + 1] = reset
  out[#out + 1] = retry
  out[#out + 1] = delay
  if allowed == 1 then
    commits[#commits + 1] = commit
  elseif ARGV[a + 6] ~= '1' then
    all = false
  end
end

if all then
  for _, commit in ipairs(commits) do commit() end
end
return out
