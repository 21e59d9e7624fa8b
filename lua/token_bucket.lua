-- Token bucket (twin of src/algorithm/token_bucket.rs), in units: capacity
-- and cost in units, rate in units per microsecond.
-- Value: "<tokens in units>:<updated µs>:<unit>", PX = until the bucket is
-- full. A value written under another unit (the quota changed) counts as none.
local function token_bucket(key, now, capacity, rate, unit, _, cost_tokens, v)
  local cost = cost_tokens * unit
  local tokens, updated = capacity, now
  if v then
    local t, u, un = string.match(v, '^(%d+):(%d+):(%d+)$')
    if t and tonumber(un) == unit then
      t = tonumber(t)
      u = tonumber(u)
      local elapsed = now - u
      if elapsed < 0 then elapsed = 0 end
      local full_in = div_ceil(capacity - t, rate)
      if elapsed > full_in then elapsed = full_in end
      tokens = t + elapsed * rate
      if tokens > capacity then tokens = capacity end
      if u > now then updated = u end
    end
  end
  if cost <= tokens then
    local left = tokens - cost
    local reset = div_ceil(capacity - left, rate)
    -- The wait before another request of this cost would pass (the local
    -- deny cache answers it until then; see dispatch.lua).
    local next_in = 0
    if cost > left and cost <= capacity then next_in = div_ceil(cost - left, rate) end
    return 1, div_floor(left, unit), reset, next_in, 0, function()
      redis.call('SET', key, string.format('%d:%d:%d', left, updated, unit), 'PX', ttl_ms(reset))
      return left -- for a refund (lua/refund.lua)
    end
  end
  local reset = div_ceil(capacity - tokens, rate)
  local retry = reset
  if cost <= capacity then retry = div_ceil(cost - tokens, rate) end
  return 0, div_floor(tokens, unit), reset, retry, 0, nil
end
