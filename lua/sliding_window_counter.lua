-- Sliding window counter (twin of src/algorithm/sliding_window_counter.rs).
-- Value: "<current window start µs>:<current>:<previous>", PX = until both
-- counters are back to zero. Everything is multiplied by the window length,
-- so the interpolation is exact in integers.
local function counter_reset(start, window, prev, cur, now)
  if cur > 0 then return start + 2 * window - now end
  if prev > 0 then return start + window - now end
  return 0
end

local function sliding_window_counter(key, now, limit, window, _, _, cost, v)
  local start = div_floor(now, window) * window
  local prev, cur = 0, 0
  if v then
    local s, c, p = string.match(v, '^(%d+):(%d+):(%d+)$')
    if s then
      s = tonumber(s)
      if s == start then
        prev, cur = tonumber(p), tonumber(c)
      elseif s + window == start then
        prev, cur = tonumber(c), 0
      end
    end
  end
  local e = now - start
  local cap = limit * window
  local est = prev * (window - e) + cur * window
  if est + cost * window <= cap then
    local after = est + cost * window
    local reset = counter_reset(start, window, prev, cur + cost, now)
    return 1, div_floor(cap - after, window), reset, 0, 0, function()
      redis.call('SET', key, string.format('%d:%d:%d', start, cur + cost, prev), 'PX', ttl_ms(reset))
    end
  end
  local reset = counter_reset(start, window, prev, cur, now)
  local retry
  if cost > limit then
    retry = reset
  elseif cur + cost <= limit then
    local room = (limit - cost - cur) * window
    retry = start + window - div_floor(room, prev) - now
  else
    local room = (limit - cost) * window
    local wait = 0
    if cur > 0 then
      wait = window - div_floor(room, cur)
      if wait < 0 then wait = 0 end
    end
    retry = start + window + wait - now
  end
  local left = cap - est
  if left < 0 then left = 0 end
  return 0, div_floor(left, window), reset, retry, 0, nil
end
