-- Sliding window counter (twin of src/algorithm/sliding_window_counter.rs).
-- PX = until both counters are back to zero. Everything is multiplied by the
-- window length, so the interpolation is exact in integers.
-- Values (docs/redis.md, "Stored values"), with b = isqrt(window):
--   "<current window start µs + previous × b + current>", an integer, when
--   limit < b (both counts are below b, and the sum below the window);
--   else "<current window start µs>:<current>:<previous>"

-- The (start, current, previous) of a value, or nil.
local function counter_read(v, window)
  local s, c, p = string.match(v, '^(%d+):(%d+):(%d+)$')
  if s then return tonumber(s), tonumber(c), tonumber(p) end
  local x = tonumber(string.match(v, '^(%d+)$'))
  if not x then return nil end
  s = div_floor(x, window) * window
  local b = isqrt(window)
  local packed = x - s
  local prev = div_floor(packed, b)
  return s, packed - prev * b, prev
end

local function counter_value(limit, window, s, cur, prev)
  local b = isqrt(window)
  if limit < b then return int(s + prev * b + cur) end
  return string.format('%d:%d:%d', s, cur, prev)
end

local function counter_reset(start, window, prev, cur, now)
  if cur > 0 then return start + 2 * window - now end
  if prev > 0 then return start + window - now end
  return 0
end

-- The window of now, and the previous and current windows' counts in v.
local function counter_counts(v, window, now)
  local start = div_floor(now, window) * window
  local prev, cur = 0, 0
  if v then
    local s, c, p = counter_read(v, window)
    if s == start then
      prev, cur = p, c
    elseif s and s + window == start then
      prev, cur = c, 0
    end
  end
  return start, prev, cur
end

-- A key listed again in one call (flag +4, dispatch.lua): cost charged on
-- v, what the earlier listing stored, whether or not it still fits (twin of
-- counter_charge): the value, PX and undo value (none, as a window's).
local function sliding_window_counter_charge(_, now, limit, window, _, _, cost, v, _)
  local start, prev, cur = counter_counts(v, window, now)
  return counter_value(limit, window, start, cur + cost, prev),
    ttl_ms(counter_reset(start, window, prev, cur + cost, now)), 0
end

local function sliding_window_counter(key, now, limit, window, _, _, cost, v, _)
  local start, prev, cur = counter_counts(v, window, now)
  local e = now - start
  local cap = limit * window
  local est = prev * (window - e) + cur * window
  if est + cost * window <= cap then
    local after = est + cost * window
    local reset = counter_reset(start, window, prev, cur + cost, now)
    return 1, div_floor(cap - after, window), reset, 0, 0,
      counter_value(limit, window, start, cur + cost, prev), ttl_ms(reset), 0
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
