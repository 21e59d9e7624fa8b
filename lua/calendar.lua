-- Calendar window (twin of CalendarWindow in src/algorithm/calendar.rs):
-- a fixed window over calendar boundaries (local midnights of days, weeks,
-- months, years in a time zone). No zone tables here: the app sends three
-- consecutive boundaries b0 < b1 < b2 (p2..p4, epoch µs) computed around its
-- own clock, at least half a window from either edge, and this script picks
-- the window by its clock (Redis TIME): [b0, b1) before b1, [b1, b2) before
-- b2; outside [b0, b2) (an app clock more than half a window off Redis's)
-- windows as long as the nearest one, repeated from b0 backward or from b2
-- forward. p1 is the limit. Stored as a fixed window's value
-- (fixed_window.lua: "<window start µs + count>" when limit < window);
-- PX = until the window ends, plus one minute.

local function calendar_window(now, b0, b1, b2)
  if now < b0 then
    local len = b1 - b0
    local start = b0 - div_ceil(b0 - now, len) * len
    return start, len
  end
  if now < b1 then return b0, b1 - b0 end
  if now < b2 then return b1, b2 - b1 end
  local len = b2 - b1
  return b2 + div_floor(now - b2, len) * len, len
end

local function calendar(key, now, limit, b0, b1, b2, cost, v, short)
  local start, window = calendar_window(now, b0, b1, b2)
  return window_decide(now, limit, start, window, cost, v, 60000000, short)
end

-- A key listed again (see fixed_window_charge).
local function calendar_charge(_, now, limit, b0, b1, b2, cost, v, _)
  local start, window = calendar_window(now, b0, b1, b2)
  return window_charge(now, limit, start, window, cost, v, 60000000)
end
