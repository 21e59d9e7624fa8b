-- Shared by the two entry points, check.lua (a single Redis) and cluster.lua
-- (one hash slot of a cluster); joined right before either of them.

local algorithms = {
  fixed_window, sliding_window_log, sliding_window_counter, token_bucket, leaky_bucket,
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
-- cost, flags: +1 shadow, +2 undo wanted (check.lua)) and its stored value
-- v (from read_states). Returns allowed
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
  local allowed, remaining, reset, retry, delay, commit = algorithm(
    key, now,
    tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]),
    tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), v)
  return allowed, remaining, reset, retry, delay, commit, tonumber(ARGV[a + 6]) % 2 == 1
end
