-- Sliding window counter (twin of src/algorithm/sliding_window_counter.rs).
-- PX = until both counters are back to zero. Everything is multiplied by the
-- window length, so the interpolation is exact in integers.
-- Values (docs/redis.md, "Stored values"), with b = isqrt(window), under
-- the tier's configured window length (its home: no home suffix):
--   "<current window start µs + previous × b + current>", an integer, when
--   limit < b (both counts are below b, and the sum below the window);
--   else "<current window start µs>:<current>:<previous>"
-- and under another window length "<start>:<current>:<previous>:<window>".
-- Read under a quota of another window length, a value's estimate at now
-- (rounded up) is the count of the quota's current window, the previous
-- one empty (CounterState in the twin).

-- The (start, current, previous, window length) of a value, whose home
-- forms are of window length hw, or nil.
local function counter_read(v, hw)
  local x = tonumber(v)
  if not x then
    local s, c, p, w = string.match(v, '^(%d+):(%d+):(%d+):?(%d*)$')
    if not s then
      local l = live_part(v)
      if l then return counter_read(l, hw) end
      return nil
    end
    if w == '' then w = hw else w = tonumber(w) end
    return tonumber(s), tonumber(c), tonumber(p), w
  end
  local s = div_floor(x, hw) * hw
  local b = isqrt(hw)
  local packed = x - s
  local prev = div_floor(packed, b)
  return s, packed - prev * b, prev, hw
end

-- The value of (s, cur, prev) in windows of `window`; home (not nil: the
-- tier's quota is not its configured one) tags it with the length.
local function counter_value(limit, window, home, s, cur, prev)
  if home then return format('%d:%d:%d:%d', s, cur, prev, window) end
  local b = isqrt(window)
  if limit < b and prev < b then return int(s + prev * b + cur) end
  return format('%d:%d:%d', s, cur, prev)
end

local function counter_reset(start, window, prev, cur, now)
  if cur > 0 then return start + 2 * window - now end
  if prev > 0 then return start + window - now end
  return 0
end

-- The estimate at now of (s, c, p) in windows of w, rounded up (twin of
-- CounterState::estimate_at): exact, as (2 × limit + 1) × w <= 2^53 held
-- for the quota that wrote it.
local function counter_estimate(s, c, p, w, now)
  if now < s then return 0 end
  local e = now - s
  local scaled = 0
  if e < w then
    scaled = p * (w - e) + c * w
  elseif e < 2 * w then
    scaled = c * (2 * w - e)
  end
  return div_ceil(scaled, w)
end

-- The window of now, and the previous and current windows' counts in v,
-- whose home forms are of window length hw; and whether v was written in
-- windows of another length (its estimate carried over).
local function counter_counts(v, window, now, limit, hw)
  local start = div_floor(now, window) * window
  local prev, cur, moved = 0, 0, false
  if v then
    local s, c, p, w = counter_read(v, hw)
    if w and w ~= window then
      -- Another window length: its estimate now, as this window's count
      -- (at most 2^53 / window - limit - 1, so every product stays exact;
      -- most_carried in the twin).
      cur = counter_estimate(s, c, p, w, now)
      moved = true
      local most = div_floor(9007199254740992, window) - limit - 1
      if most < limit then most = limit end
      if cur > most then cur = most end
    elseif s == start then
      prev, cur = p, c
    elseif s and s + window == start then
      prev, cur = c, 0
    end
  end
  return start, prev, cur, moved
end

-- A key listed again in one call (flag +4, dispatch.lua): cost charged on
-- v, what the earlier listing stored, whether or not it still fits (twin of
-- counter_charge): the value, PX and undo value (none, as a window's).
local function sliding_window_counter_charge(_, now, limit, window, _, _, cost, v, _, home)
  local start, prev, cur = counter_counts(v, window, now, limit, home or window)
  return counter_value(limit, window, home, start, cur + cost, prev),
    ttl_ms(counter_reset(start, window, prev, cur + cost, now)), 0
end

local function sliding_window_counter(key, now, limit, window, _, _, cost, v, _, home)
  local start, prev, cur, moved = counter_counts(v, window, now, limit, home or window)
  -- Carried over from windows of another length: stored whatever the
  -- decision (dispatch.lua; Limit::carry in the twin).
  local cv, cpx
  if moved and cur > 0 then
    cv = counter_value(limit, window, home, start, cur, 0)
    cpx = ttl_ms(counter_reset(start, window, 0, cur, now))
  end
  local e = now - start
  local cap = limit * window
  local est = prev * (window - e) + cur * window
  if est + cost * window <= cap then
    local after = est + cost * window
    local reset = counter_reset(start, window, prev, cur + cost, now)
    return 1, div_floor(cap - after, window), reset, 0, 0,
      counter_value(limit, window, home, start, cur + cost, prev), ttl_ms(reset), 0, cv, cpx
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
  return 0, div_floor(left, window), reset, retry, 0, nil, nil, nil, cv, cpx
end
