-- The Redis Cluster entry point (src/backend/redis/cluster.rs): the tiers of
-- one request that share a hash slot, in one script call; or the refund of
-- a charge made by such a call. Joined after the algorithm files and
-- refund.lua, instead of check.lua.
--
-- ARGV[1]   'check' or 'refund'
-- ARGV[2]   the clock, as ARGV[1] of check.lua: "" = Redis TIME, or a test
--           clock "<now µs>[:<ttl slack ms>]"
--
-- check:    KEYS and seven ARGV per tier from ARGV[3] on, exactly as in
--           check.lua (algorithm, p1, p2, p3, p4, cost, shadow), with the
--           same commit rule among these tiers.
--   returns { now_us, committed (0/1), then per tier: allowed (0/1),
--             remaining, reset_after_us, retry_after_us, delay_us, undo }
--           where undo is what the tier's charge returned (0 if none): the
--           argument a refund needs.
-- refund:   KEYS = the keys to refund (tiers this script charged), eight
--           ARGV per key from ARGV[3] on: algorithm, p1, p2, p3, p4, cost,
--           charged_at (the now_us the check returned), undo.
--   returns the number of keys refunded.

local refunds = {
  fixed_window_refund, sliding_window_log_refund, sliding_window_counter_refund,
  token_bucket_refund, leaky_bucket_refund,
}

local now = read_clock(ARGV[2])

if ARGV[1] == 'refund' then
  for i = 1, #KEYS do
    local a = 3 + (i - 1) * 8
    local refund = refunds[tonumber(ARGV[a])]
    if not refund then
      return redis.error_reply('unknown algorithm ' .. tostring(ARGV[a]))
    end
    refund(KEYS[i], now, tonumber(ARGV[a + 6]),
      tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]),
      tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), tonumber(ARGV[a + 7]))
  end
  return #KEYS
end

if ARGV[1] ~= 'check' then
  return redis.error_reply('unknown mode ' .. tostring(ARGV[1]))
end

local out = { now, 0 }
local commits = {}
local all = true
local states = read_states(#KEYS)
for i = 1, #KEYS do
  local a = 3 + (i - 1) * 7
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
  elseif not shadow then
    all = false
  end
end

if all then
  out[2] = 1
  for _, c in ipairs(commits) do
    out[c[2]] = c[1]() or 0
  end
end
return out
