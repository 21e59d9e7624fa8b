-- Fixed window (twin of src/algorithm/fixed_window.rs). PX = until the
-- window ends. Values (docs/redis.md, "Stored values"):
--   "<window start µs + count>", an integer, when limit < window (the start
--   is a multiple of the window, so the count is what lies above it);
--   else "<window start µs>:<count>"

-- The count of a value in the window starting at `start`, 0 for another.
local function window_count(v, start, window)
  local s, c = string.match(v, '^(%d+):(%d+)$')
  if s then
    if tonumber(s) == start then return tonumber(c) end
    return 0
  end
  local x = tonumber(string.match(v, '^(%d+)$'))
  if x and x >= start and x < start + window then return x - start end
  return 0
end

local function window_value(limit, window, start, count)
  if limit < window then return int(start + count) end
  return string.format('%d:%d', start, count)
end

-- The decision in the window [start, start + window) for cost at now, and
-- the value to store (PX: until the window ends, plus margin µs). Shared
-- with the calendar window (calendar.lua). short (the tier flag +8, see
-- dispatch.lua): answer only the count in the window before this request,
-- as `remaining`; the client derives the rest (src/backend/redis/wire).
local function window_decide(now, limit, start, window, cost, v, margin, short)
  local count = 0
  if v then count = window_count(v, start, window) end
  local end_in = start + window - now
  if short then
    if count + cost <= limit then
      return 1, count, 0, 0, 0, window_value(limit, window, start, count + cost),
        ttl_ms(end_in + margin), 0
    end
    return 0, count, 0, 0, 0, nil
  end
  if count + cost <= limit then
    local after = count + cost
    -- The wait before another request of this cost would pass.
    local next_in = 0
    if after + cost > limit and cost <= limit then next_in = end_in end
    return 1, limit - after, end_in, next_in, 0,
      window_value(limit, window, start, after), ttl_ms(end_in + margin), 0
  end
  local reset = end_in
  if count == 0 then reset = 0 end
  local remaining = limit - count
  if remaining < 0 then remaining = 0 end
  local retry = end_in
  if cost > limit then retry = reset end
  return 0, remaining, reset, retry, 0, nil
end

local function fixed_window(key, now, limit, window, _, _, cost, v, short)
  return window_decide(now, limit, div_floor(now, window) * window, window, cost, v, 0, short)
end

-- A key listed again in one call (flag +4, dispatch.lua): cost charged on
-- v, what the earlier listing stored, whether or not it still fits (twin of
-- fixed_window::charge_in): the value, PX and undo value (none: a window's
-- refund takes its cost off). Shared with the calendar.
local function window_charge(now, limit, start, window, cost, v, margin)
  local count = 0
  if v then count = window_count(v, start, window) end
  return window_value(limit, window, start, count + cost), ttl_ms(start + window - now + margin), 0
end

local function fixed_window_charge(_, now, limit, window, _, _, cost, v, _)
  return window_charge(now, limit, div_floor(now, window) * window, window, cost, v, 0)
end
