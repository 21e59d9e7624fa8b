-- Concurrency (twin of src/algorithm/concurrency.rs): requests in flight.
-- A sorted set: one member per admitted request still running, its slot id
-- ("<id>"), scored by the slot's expiry (µs). A slot counts while
-- expires > now. The charge trims expired slots, adds this request's and
-- sets PX to the latest expiry; the front door's release removes the member
-- (ZREM), a renewal moves its score (lua/slot.lua). A request takes one
-- slot whatever its cost.
--
-- p1 = limit, p2 = ttl_us, p3 = this request's slot id (< 2^53).
-- A denial's retry is the wait until the earliest slot expires, at most
-- 1 s (an estimate: slots free when responses end), never 0.

local concurrency_retry_us = 1000000

-- The live slots of key at now: their count, and the waits (µs) until the
-- earliest and the latest expire (0 when none). A key of another type
-- counts as none.
local function slots_live(key, now)
  local n = redis.pcall('ZCOUNT', key, '(' .. int(now), '+inf')
  if type(n) ~= 'number' or n == 0 then return 0, 0, 0, type(n) ~= 'number' end
  local first = rcall('ZRANGEBYSCORE', key, '(' .. int(now), '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  local last = rcall('ZREVRANGE', key, 0, 0, 'WITHSCORES')
  return n, tonumber(first[2]) - now, tonumber(last[2]) - now, false
end

local function concurrency(key, now, limit, ttl_us, slot, _, _, _, _)
  local n, earliest, latest, foreign = slots_live(key, now)
  if n < limit then
    local reset = latest
    if reset < ttl_us then reset = ttl_us end
    return 1, limit - n - 1, reset, 0, 0, function()
      if foreign then rcall('DEL', key) end
      rcall('ZREMRANGEBYSCORE', key, '-inf', int(now))
      rcall('ZADD', key, int(now + ttl_us), int(slot))
      rcall('PEXPIRE', key, ttl_ms(reset))
      return 0
    end
  end
  local retry = earliest
  if retry > concurrency_retry_us then retry = concurrency_retry_us end
  if retry < 1 then retry = 1 end
  return 0, 0, latest, retry, 0, nil
end

-- A cross-slot refund (lua/cluster.lua's refund mode) releases the slot.
local function concurrency_refund(key, _, _, _, _, slot, _, _, _)
  redis.pcall('ZREM', key, int(slot))
end
