-- Leaky bucket as GCRA (twin of src/algorithm/gcra.rs). Time in ticks of
-- 1/rate µs; the state is the TAT, tat + frac / rate µs, and the quota it
-- was written under, stored as tat_value (common.lua): one integer for a
-- rate up to 44 under the tier's configured unit (`home` nil), a string
-- otherwise. Read under another quota, the backlog carries over in
-- requests (carry_units, as the token bucket's missing tokens).
-- max_delay < 0 polices (reject excess); max_delay >= 0 shapes (delay up to
-- max_delay µs, returned as the delay). PX = until the TAT.

-- The backlog in ticks at `now` of the stored value v under the quota
-- (rate, unit) of a tier whose configured unit is hunit, or nil when v is
-- not a bucket's value or its TAT is past: exact under the quota it was
-- written with; under another, carried over (at most 2^52 ticks, so the
-- arithmetic stays exact).
local function leaky_backlog(v, rate, unit, hunit, now)
  local t, f, r, u = tat_read(v)
  if not t then return nil end
  if t < now then return nil end
  u = u or hunit
  local d = t - now
  if r == rate and u == unit then return d * rate + f end
  local most = div_floor(4503599627370496, r)
  if d > most then d = most end
  return carry_units(d * r + f, u, unit), true
end

-- The value of a backlog of `backlog` ticks at `now`: its TAT; `home` (not
-- nil) tags it with its unit.
local function leaky_value(now, backlog, rate, unit, home)
  if rate == 1 and not home then return int(now + backlog) end
  local whole = div_floor(backlog, rate)
  if home then return tat_value(now + whole, backlog - whole * rate, rate, unit) end
  return tat_value(now + whole, backlog - whole * rate, rate)
end

-- short (the tier flag +8, see dispatch.lua): answer only the backlog at
-- `now` (ticks), as `remaining`; the client derives the rest
-- (src/backend/redis/wire/mod.rs), so no division is done here.
local function leaky_bucket(key, now, capacity, rate, unit, max_delay, cost_tokens, v, short, home)
  local cost = cost_tokens * unit
  local backlog, moved = 0, false
  if v then
    backlog, moved = leaky_backlog(v, rate, unit, home or unit, now)
    backlog = backlog or 0
  end
  -- Carried over a quota change: stored whatever the decision (as the
  -- token bucket's).
  local cv, cpx
  if moved and backlog > 0 then
    cv, cpx = leaky_value(now, backlog, rate, unit, home), ttl_ms(div_ceil(backlog, rate))
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
    if short then
      local drained_in = after
      if rate > 1 then drained_in = div_ceil(after, rate) end
      return 1, backlog, 0, 0, 0, leaky_value(now, after, rate, unit, home), ttl_ms(drained_in), 0,
        cv, cpx
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
      leaky_value(now, after, rate, unit, home), ttl_ms(reset), after, cv, cpx
  end
  if short then return 0, backlog, 0, 0, 0, nil, nil, nil, cv, cpx end
  local reset = div_ceil(backlog, rate)
  local retry = reset
  if cost <= capacity then retry = div_ceil(over - tolerance, rate) end
  local left = capacity - backlog
  if left < 0 then left = 0 end
  return 0, div_floor(left, unit), reset, retry, 0, nil, nil, nil, cv, cpx
end

-- A key listed again in one call (flag +4, dispatch.lua): cost charged on
-- v, what the earlier listing stored, whether or not it still fits (twin of
-- Gcra::charge): the value, PX and undo value (the backlog after it).
local function leaky_bucket_charge(_, now, _, rate, unit, _, cost_tokens, v, _, home)
  local backlog = 0
  if v then backlog = leaky_backlog(v, rate, unit, home or unit, now) or 0 end
  local after = backlog + cost_tokens * unit
  return leaky_value(now, after, rate, unit, home), ttl_ms(div_ceil(after, rate)), after
end
