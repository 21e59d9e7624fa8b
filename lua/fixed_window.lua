-- Fixed window (twin of src/algorithm/fixed_window.rs). PX = until the
-- window ends. Values (docs/redis.md, "Stored values"), under the tier's
-- configured window length (its home: the spec has no home suffix):
--   "<window start µs + count>", an integer, when limit < window (the start
--   is a multiple of the window, so the count is what lies above it);
--   else "<window start µs>:<count>"
-- and under another window length (a quota changed at run time, a plan's,
-- an override's) "<window start µs>:<count>:<window end µs>". Read under
-- any quota, a value whose window is open at now keeps its count, in the
-- quota's own window of now (FixedWindowState in the twin).

-- The home window [hs, he) of now for a home window length hw.
local function home_window(now, hw)
  local hs = div_floor(now, hw) * hw
  return hs, hs + hw
end

-- The count of a value at now: its count while its window is open, else 0;
-- a value in the home forms is of the home window of now, [hs, he), or of
-- a closed one. Then the start and end of the open window it counts in.
local function window_count(v, now, hs, he)
  local x = tonumber(v)
  if x then
    if x >= hs and x < he then return x - hs, hs, he end
    return 0
  end
  local s, c, e = string.match(v, '^(%d+):(%d+):?(%d*)$')
  if not s then
    local l = live_part(v)
    if l then return window_count(l, now, hs, he) end
    return 0
  end
  s = tonumber(s)
  if e ~= '' then
    e = tonumber(e)
    if s <= now and now < e then return tonumber(c), s, e end
    return 0
  end
  if s == hs then return tonumber(c), hs, he end
  return 0
end

-- The value of count in [start, start + window); tag_end (not nil) writes
-- the tagged form with the window's end.
local function window_value(limit, window, start, count, tag_end)
  if tag_end then return format('%d:%d:%d', start, count, tag_end) end
  if limit < window then return int(start + count) end
  return format('%d:%d', start, count)
end

-- The decision in the window [start, start + window) for cost at now, and
-- the value to store (PX: until the window ends, plus margin µs). Shared
-- with the calendar window (calendar.lua). short (the tier flag +8, see
-- dispatch.lua): answer only the count in the window before this request,
-- as `remaining`; the client derives the rest (src/backend/redis/wire).
local function window_decide(now, limit, start, window, cost, v, margin, short, hs, he)
  local count, s, e = 0, nil, nil
  if v then count, s, e = window_count(v, now, hs or start, he or start + window) end
  -- Tagged (hs given: the tier's quota is not its configured one).
  local tag
  if hs then tag = start + window end
  -- Counted in another window (another quota's): carried into this one,
  -- stored whatever the decision (dispatch.lua; Limit::carry in the twin).
  local cv, cpx
  if count > 0 and (s ~= start or e ~= start + window) then
    cv, cpx = window_value(limit, window, start, count, tag), ttl_ms(start + window - now + margin)
  end
  local end_in = start + window - now
  if short then
    if count + cost <= limit then
      return 1, count, 0, 0, 0, window_value(limit, window, start, count + cost, tag),
        ttl_ms(end_in + margin), 0, cv, cpx
    end
    return 0, count, 0, 0, 0, nil, nil, nil, cv, cpx
  end
  if count + cost <= limit then
    local after = count + cost
    -- The wait before another request of this cost would pass.
    local next_in = 0
    if after + cost > limit and cost <= limit then next_in = end_in end
    return 1, limit - after, end_in, next_in, 0,
      window_value(limit, window, start, after, tag), ttl_ms(end_in + margin), 0, cv, cpx
  end
  local reset = end_in
  if count == 0 then reset = 0 end
  local remaining = limit - count
  if remaining < 0 then remaining = 0 end
  local retry = end_in
  if cost > limit then retry = reset end
  return 0, remaining, reset, retry, 0, nil, nil, nil, cv, cpx
end

local function fixed_window(key, now, limit, window, _, _, cost, v, short, home)
  local hs, he
  if home then hs, he = home_window(now, home) end
  return window_decide(now, limit, div_floor(now, window) * window, window, cost, v, 0, short,
    hs, he)
end

-- A key listed again in one call (flag +4, dispatch.lua): cost charged on
-- v, what the earlier listing stored, whether or not it still fits (twin of
-- fixed_window::charge_in): the value, PX and undo value (none: a window's
-- refund takes its cost off). Shared with the calendar.
local function window_charge(now, limit, start, window, cost, v, margin, hs, he)
  local count = 0
  if v then count = window_count(v, now, hs or start, he or start + window) end
  local tag
  if hs then tag = start + window end
  return window_value(limit, window, start, count + cost, tag),
    ttl_ms(start + window - now + margin), 0
end

local function fixed_window_charge(_, now, limit, window, _, _, cost, v, _, home)
  local hs, he
  if home then hs, he = home_window(now, home) end
  return window_charge(now, limit, div_floor(now, window) * window, window, cost, v, 0, hs, he)
end
