-- Leaky bucket as GCRA (twin of src/algorithm/gcra.rs). Time in ticks of
-- 1/rate µs; the value is "<tat µs>:<remainder ticks>:<rate>" (a value
-- written under another rate counts as none).
-- max_delay < 0 polices (reject excess); max_delay >= 0 shapes (delay up to
-- max_delay µs, returned as the delay). PX = until the TAT.
local function leaky_bucket(key, now, capacity, rate, unit, max_delay, cost_tokens, v)
  local cost = cost_tokens * unit
  local backlog = 0
  if v then
    local t, f, r = string.match(v, '^(%d+):(%d+):(%d+)$')
    if t and tonumber(r) == rate then
      t = tonumber(t)
      if t >= now then backlog = (t - now) * rate + tonumber(f) end
    end
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
    return 1, div_floor(left, unit), reset, next_in, div_ceil(over, rate), function()
      local whole = div_floor(after, rate)
      redis.call('SET', key, string.format('%d:%d:%d', now + whole, after - whole * rate, rate), 'PX', ttl_ms(reset))
      return after -- for a refund (lua/refund.lua)
    end
  end
  local reset = div_ceil(backlog, rate)
  local retry = reset
  if cost <= capacity then retry = div_ceil(over - tolerance, rate) end
  local left = capacity - backlog
  if left < 0 then left = 0 end
  return 0, div_floor(left, unit), reset, retry, 0, nil
end
