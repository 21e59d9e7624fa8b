-- Shared by the two entry points, check.lua (a single Redis) and cluster.lua
-- (one hash slot of a cluster); joined right before either of them.

local algorithms = {
  fixed_window, sliding_window_log, sliding_window_counter, token_bucket, leaky_bucket,
  concurrency, penalty,
}

-- The clock argument: "" reads Redis TIME; "d<deadline µs>" reads Redis TIME
-- and also returns the deadline; "<µs>[:<ttl slack ms>]" is a test clock
-- (ManualClock; tests only). Returns now (µs) and the deadline, if any.
local function read_clock(arg)
  local deadline = string.match(arg, '^d(%d+)$')
  if arg ~= '' and not deadline then
    local clock, slack = string.match(arg, '^(%d+):?(%d*)$')
    if slack ~= nil and slack ~= '' then ttl_slack_ms = tonumber(slack) end
    return tonumber(clock), nil
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2]), tonumber(deadline)
end

-- The stored values of KEYS[1..n], in one MGET (one command however many
-- tiers; a sorted-set key of the sliding log reads as false, and that
-- algorithm reads its set itself).
local function read_states(n)
  if n == 0 then return {} end
  return redis.call('MGET', unpack(KEYS, 1, n))
end

-- Runs one tier from its seven ARGV starting at index a (algorithm, p1..p4,
-- cost, flags: +1 shadow, +2 undo wanted, +4 write the compact format
-- (check.lua)) and its stored value v (from read_states). Returns allowed
-- (0/1), remaining, reset_after_us, retry_after_us, delay_us, the commit
-- function (or nil) and whether the tier is in shadow mode; false alone for
-- an unknown algorithm.
--
-- retry_after_us of an ALLOWED tier is the wait, once it is charged, before
-- another request of the same cost would pass (0: at once, or not computed:
-- the sliding window algorithms return 0). The client reads it only when
-- the request was charged, to prime its deny cache; the decision it reports
-- has retry_after_us = 0.
local function check_tier(key, now, a, v)
  local algorithm = algorithms[tonumber(ARGV[a])]
  if not algorithm then return false end
  local flags = tonumber(ARGV[a + 6])
  local allowed, remaining, reset, retry, delay, commit = algorithm(
    key, now,
    tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]),
    tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), v, has_flag(flags, 4))
  return allowed, remaining, reset, retry, delay, commit, has_flag(flags, 1)
end

-- One request's check of tiers 1..n, the body of both entry points (a
-- single Redis: check.lua; one hash slot of a cluster: cluster.lua's
-- 'check'): clock is the clock argument (see read_clock); tier i is KEYS[i]
-- and seven ARGV from ARGV[first + 7(i-1)] (see check_tier).
-- Decides every tier first; charges only if every enforced tier allows the
-- request, and then every tier that allows it (a shadow tier that would deny
-- is not charged, just as an enforced denial charges nothing).
-- Returns the check reply, whose layout is documented once, in
-- src/backend/redis/wire/mod.rs:
--   { now_us, three per tier: r, reset_after_us, w,
--     then a trailer, three per entry: i, delay_us, undo }
--   or { now_us, -1 } when the clock's deadline has passed (nothing written);
-- and the numbers of the tiers that rejected. For an unknown algorithm:
-- nil and the error message.
local function check_request(clock, first, n)
  local now, deadline = read_clock(clock)
  if deadline and now > deadline then
    return { now, -1 }, {}
  end
  local out = { now }
  local commits = {}
  local rejected = {}
  local all = true
  local states = read_states(n)
  for i = 1, n do
    local a = first + (i - 1) * 7
    local allowed, remaining, reset, retry, delay, commit, shadow = check_tier(KEYS[i], now, a, states[i])
    if allowed == false then
      return nil, 'unknown algorithm ' .. tostring(ARGV[a])
    end
    penalty_tier_allowed = allowed == 1 -- for a penalty box right after (penalty.lua)
    if allowed == 1 then
      out[#out + 1] = remaining
      commits[#commits + 1] = { commit, i, delay, has_flag(tonumber(ARGV[a + 6]), 2) }
    else
      out[#out + 1] = -remaining - 1
      rejected[#rejected + 1] = i
      if not shadow then all = false end
    end
    out[#out + 1] = reset
    out[#out + 1] = retry
  end
  -- The trailer: every allowing tier with a delay, or with a non-zero undo
  -- value that it asked for (flag +2) when the request was charged.
  for _, c in ipairs(commits) do
    local undo = 0
    if all then undo = c[1]() or 0 end
    if not c[4] then undo = 0 end
    if c[3] > 0 or undo ~= 0 then
      out[#out + 1] = c[2]
      out[#out + 1] = c[3]
      out[#out + 1] = undo
    end
  end
  return out, rejected
end
