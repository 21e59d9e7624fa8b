-- Leaky bucket as GCRA (twin of src/algorithm/gcra.rs). Time in ticks of
-- 1/rate µs; the state is the TAT, tat + frac / rate µs.
-- Values (docs/redis.md, "Stored values"):
--   compact "<tat µs>", an integer, when rate = 1 (the TAT in whole µs);
--           "<tat µs><ddd>", an integer, when 2 <= rate <= 21: ddd = 500 +
--           rate² + frac (so the digits say the rate, exactly)
--   both    "<tat µs>:<frac ticks>:<rate>" (legacy, and compact otherwise)
-- An integer TAT (below 10^18; or "<tat><501>", the earlier compact value
-- of rate 1) was written under rate 1 and is read under any rate: a quota
-- change carries the time until drained over (as GCRA does). Any other
-- value of another rate counts as none.
-- max_delay < 0 polices (reject excess); max_delay >= 0 shapes (delay up to
-- max_delay µs, returned as the delay). PX = until the TAT.

-- The backlog in ticks at `now` of the stored value v under `rate`, or
-- nil when v is not readable under it or its TAT is past: exact under the
-- rate it was written with; an integer TAT of rate 1 read under another
-- rate is at most 2^52 ticks away (the arithmetic stays exact).
local function leaky_backlog(v, rate, now)
  local t, f, r
  local n = tonumber(v)
  if n and n < 1e18 then
    t, f, r = n, 0, 1
  elseif n then
    local code
    t, code = split_code(v)
    if not t then return nil end
    if code == 501 then
      f, r = 0, 1
    else
      f, r = code - 500 - rate * rate, rate
      if rate > 21 or f < 0 or f >= rate then return nil end
    end
  else
    local r_
    t, f, r_ = string.match(v, '^(%d+):(%d+):(%d+)$')
    -- A string (legacy) is read only under its own rate, as before.
    if not t or tonumber(r_) ~= rate then return nil end
    t, f, r = tonumber(t), tonumber(f), rate
  end
  if t < now then return nil end
  local d = t - now
  if r == rate then return d * rate + f end
  local most = div_floor(4503599627370496, rate)
  if d > most then d = most end
  return d * rate
end

-- The value of a backlog of `backlog` ticks at `now`: its TAT.
local function leaky_value(compact, now, backlog, rate)
  if compact and rate == 1 then return int(now + backlog) end
  local whole = div_floor(backlog, rate)
  local frac = backlog - whole * rate
  if compact and rate <= 21 then
    return string.format('%d%03d', now + whole, 500 + rate * rate + frac)
  end
  return string.format('%d:%d:%d', now + whole, frac, rate)
end

-- Writes a backlog of `backlog` ticks at `now`, PX = until it drains.
local function leaky_write(key, compact, now, backlog, rate)
  redis.call('SET', key, leaky_value(compact, now, backlog, rate), 'PX', ttl_ms(div_ceil(backlog, rate)))
end

-- short (the tier flag +8, see dispatch.lua): answer only the backlog at
-- `now` (ticks), as `remaining`; the client derives the rest
-- (src/backend/redis/wire/mod.rs), so no division is done here.
local function leaky_bucket(key, now, capacity, rate, unit, max_delay, cost_tokens, v, compact, short)
  local cost = cost_tokens * unit
  local backlog = 0
  if v then backlog = leaky_backlog(v, rate, now) or 0 end
  -- A cost above the capacity never passes; leaving it out of `after` keeps
  -- every value at or below 2^53 (the quota checks assume it).
  local after = backlog
  if cost <= capacity then after = backlog + cost end
  local over = after - capacity
  if over < 0 then over = 0 end
  local tolerance = 0
  if max_delay >= 0 then tolerance = max_delay * rate end
  if over <= tolerance and cost <= capacity then
    if short then
      local drained_in = after
      if rate > 1 then drained_in = div_ceil(after, rate) end
      return 1, backlog, 0, 0, 0, leaky_value(compact, now, after, rate), ttl_ms(drained_in), 0
    end
    local left = capacity - after
    if left < 0 then left = 0 end
    local reset = div_ceil(after, rate)
    -- The wait before another request of this cost would pass.
    local next_in = 0
    local next_over = after + cost - capacity
    if next_over > tolerance and cost <= capacity then next_in = div_ceil(next_over - tolerance, rate) end
    -- The write (value, PX) and the undo value for a refund (lua/refund.lua).
    return 1, div_floor(left, unit), reset, next_in, div_ceil(over, rate),
      leaky_value(compact, now, after, rate), ttl_ms(reset), after
  end
  if short then return 0, backlog, 0, 0, 0, nil end
  local reset = div_ceil(backlog, rate)
  local retry = reset
  if cost <= capacity then retry = div_ceil(over - tolerance, rate) end
  local left = capacity - backlog
  if left < 0 then left = 0 end
  return 0, div_floor(left, unit), reset, retry, 0, nil
end
