-- Fixed window (twin of src/algorithm/fixed_window.rs).
-- Value: "<window start µs>:<count>", PX = until the window ends.
local function fixed_window(key, now, limit, window, _, _, cost, v)
  local start = div_floor(now, window) * window
  local count = 0
  if v then
    local s, c = string.match(v, '^(%d+):(%d+)$')
    if s and tonumber(s) == start then count = tonumber(c) end
  end
  local end_in = start + window - now
  if count + cost <= limit then
    local after = count + cost
    -- The wait before another request of this cost would pass.
    local next_in = 0
    if after + cost > limit and cost <= limit then next_in = end_in end
    return 1, limit - after, end_in, next_in, 0, function()
      redis.call('SET', key, string.format('%d:%d', start, after), 'PX', ttl_ms(end_in))
    end
  end
  local reset = end_in
  if count == 0 then reset = 0 end
  local remaining = limit - count
  if remaining < 0 then remaining = 0 end
  local retry = end_in
  if cost > limit then retry = reset end
  return 0, remaining, reset, retry, 0, nil
end
