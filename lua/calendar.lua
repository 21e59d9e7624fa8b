-- Calendar window (twin of CalendarWindow in src/algorithm/calendar.rs):
-- a fixed window over calendar boundaries (local midnights of days, weeks,
-- months, years in a time zone). No zone tables here: the app sends three
-- consecutive boundaries b0 < b1 < b2 (p2..p4, epoch µs) computed around its
-- own clock, at least half a window from either edge, and this script picks
-- the window by its clock (Redis TIME): [b0, b1) before b1, [b1, b2) before
-- b2; outside [b0, b2) (an app clock more than half a window off Redis's)
-- windows as long as the nearest one, repeated from b0 backward or from b2
-- forward. p1 is the limit. Stored as a fixed window's value
-- (fixed_window.lua: "<window start µs + count>" when limit < window, the
-- tagged form under another calendar than the configured one); PX = until
-- the window ends, plus one minute.

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

-- home (not nil: the tier's calendar is not its configured one): the
-- configured calendar's three boundaries, { b0, b1, b2 }, whose window of
-- now a value in the home forms counts in.
local function calendar_home(now, home)
  if not home then return nil end
  local hs, hlen = calendar_window(now, home[1], home[2], home[3])
  return hs, hs + hlen
end

local function calendar(key, now, limit, b0, b1, b2, cost, v, short, home)
  local start, window = calendar_window(now, b0, b1, b2)
  local hs, he = calendar_home(now, home)
  return window_decide(now, limit, start, window, cost, v, 60000000, short, hs, he)
end

-- A key listed again (see fixed_window_charge).
local function calendar_charge(_, now, limit, b0, b1, b2, cost, v, _, home)
  local start, window = calendar_window(now, b0, b1, b2)
  local hs, he = calendar_home(now, home)
  return window_charge(now, limit, start, window, cost, v, 60000000, hs, he)
end
