-- Leaky bucket as GCRA (twin of src/algorithm/gcra.rs). Time in ticks of
-- 1/rate µs; the state is the TAT, tat + frac / rate µs.
-- Values (docs/redis.md, "Stored values"):
--   compact "<tat µs><ddd>", an integer, when rate <= 21: ddd = 500 +
--           rate² + frac (so the digits say the rate, exactly)
--   both    "<tat µs>:<frac ticks>:<rate>" (legacy, and compact otherwise)
-- A value written under another rate counts as none.
-- max_delay < 0 polices (reject excess); max_delay >= 0 shapes (delay up to
-- max_delay µs, returned as the delay). PX = until the TAT.

-- The TAT (µs and remainder) of a value written under this rate, or nil.
local function leaky_tat(v, rate)
  local tat, code = split_code(v)
  if tat then
    local frac = code - 500 - rate * rate
    if rate <= 21 and frac >= 0 and frac < rate then return tat, frac end
    return nil
  end
  local t, f, r = string.match(v, '^(%d+):(%d+):(%d+)$')
  if t and tonumber(r) == rate then return tonumber(t), tonumber(f) end
  return nil
end

-- The value of a backlog of `backlog` ticks at `now`: its TAT.
local function leaky_value(compact, now, backlog, rate)
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

local function leaky_bucket(key, now, capacity, rate, unit, max_delay, cost_tokens, v, compact)
  local cost = cost_tokens * unit
  local backlog = 0
  if v then
    local t, f = leaky_tat(v, rate)
    if t and t >= now then backlog = (t - now) * rate + f end
  end
  -- A cost above the capacity never passes; leaving it out of `after` keeps
  -- every value at or below 2^53 (the quota checks assume it).
  local after = backlog
  if cost <= capacity then after = backlog + cost end
  local over = after - capacity
  if over < 0 then over = 0 end
  local tolerance = 0
  if max_delay >= 0 then tolerance = max_delay * rate end
  if over <= tolerance and cost <= capacity then
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
  local reset = div_ceil(backlog, rate)
  local retry = reset
  if cost <= capacity then retry = div_ceil(over - tolerance, rate) end
  local left = capacity - backlog
  if left < 0 then left = 0 end
  return 0, div_floor(left, unit), reset, retry, 0, nil
end
