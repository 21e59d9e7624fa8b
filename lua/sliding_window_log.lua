-- Sliding window log (twin of src/algorithm/sliding_window_log.rs).
-- A sorted set: score = admission time (µs), one member per admission:
--   "<time>" (16 digits), an integer, for a cost of 1 charged by
--   check_plain (dispatch.lua: no undo value asked for, so no refund
--   names it) when no other entry of that µs has the name; else
--   "<time><seq, three digits>", an integer, for a cost of 1 and a seq
--   below 1000; else "<time>:<seq>:<cost>"
-- (a member without ':' costs 1). An entry counts while now < time + window. PX = one window
-- after the newest entry. Denied requests are not logged.
--
-- The marker: the member "u" at score -inf, kept only while every entry
-- in the set costs 1, so that the count of entries is their cost (what
-- check_plain in dispatch.lua reads with one ZREVRANK instead of the
-- members). Entries leave by score from "(-inf", which spares it. Added by
-- check_plain (a tier of cost 1 listed once in its call: the key empty, or
-- every live entry read costing 1); removed by any write of a cost other
-- than 1; a set without it (written before it existed, or holding an
-- entry of another cost) is read member by member, as below.
local log_marker = 'u'

-- The member names an admission at `time` can have: the integer one (when
-- it has one), then the string one (which only a cost above 1 or a seq of
-- 1000 or more uses; a refund removes both names).
local function log_members(time, seq, cost)
  local long = int(time) .. ':' .. seq .. ':' .. int(cost)
  if cost == 1 and seq < 1000 then return with_code(time, seq), long end
  return nil, long
end

-- Adds the entry of (now, seq, cost) under the first seq from `seq` whose
-- names are not taken (a refund removes both): only the name written can
-- be (log_members gives a cost of 1 and a seq below 1000 its integer name
-- only), so ZADD NX tells. Returns the seq.
local function log_add(key, now, seq, cost)
  local at = int(now)
  while true do
    -- log_members' name of (now, seq, cost), without the one not written.
    local member
    if cost == 1 and seq < 1000 then
      member = with_code(now, seq)
    else
      member = at .. ':' .. seq .. ':' .. int(cost)
    end
    if rcall('ZADD', key, 'NX', at, member) == 1 then return seq end
    seq = seq + 1
  end
end

-- A denial's numbers from the live entries' times (read only on a
-- denial): allowed 0, remaining, reset, retry (the wait until enough cost
-- has left the window, oldest first).
local function log_denied(key, now, limit, window, cost, cutoff, foreign)
  local used, newest = 0, nil
  local times, costs = {}, {}
  local live = {}
  if not foreign then
    live = redis.pcall('ZRANGEBYSCORE', key, '(' .. cutoff, '+inf', 'WITHSCORES')
    if type(live) == 'table' and live.err ~= nil then live = {} end
  end
  for i = 1, #live, 2 do
    local c = tonumber(string.match(live[i], ':(%d+)$')) or 1
    local t = tonumber(live[i + 1])
    used = used + c
    times[#times + 1] = t
    costs[#costs + 1] = c
    if newest == nil or t > newest then newest = t end
  end
  local reset = 0
  if newest then reset = newest + window - now end
  local retry = reset
  if cost <= limit then
    local need = used + cost - limit
    local freed = 0
    for i = 1, #times do
      freed = freed + costs[i]
      if freed >= need then
        retry = times[i] + window - now
        break
      end
    end
  end
  local remaining = limit - used
  if remaining < 0 then remaining = 0 end
  return 0, remaining, reset, retry, 0, nil
end

-- `mark`: check_plain's call for a tier of cost 1 listed once, which may
-- add the marker when every live entry costs 1 (the general loop never
-- does: a later listing of the key in the same call may log another cost).
local function sliding_window_log(key, now, limit, window, _, _, cost, _, _, mark)
  local cutoff = int(now - window)
  -- A key of another type (the algorithm changed) is no state; the commit
  -- deletes it before logging. The members alone (a cost is in a member's
  -- name): the times are read only for a denial's reset and retry. The
  -- marker (score -inf) is not among them.
  local live = redis.pcall('ZRANGEBYSCORE', key, '(' .. cutoff, '+inf')
  local foreign = type(live) == 'table' and live.err ~= nil
  if foreign then live = {} end
  local used, unit = 0, true
  for i = 1, #live do
    local m = live[i]
    if string.find(m, ':', 1, true) then
      local c = tonumber(string.match(m, ':(%d+)$')) or 1
      used = used + c
      if c ~= 1 then unit = false end
    else
      used = used + 1
    end
  end
  if used + cost <= limit then
    local entries = #live
    return 1, limit - used - cost, window, 0, 0, function()
      if foreign then rcall('DEL', key) end
      -- Entries out of the window leave; the marker stays.
      rcall('ZREMRANGEBYSCORE', key, '(-inf', cutoff)
      local seq = log_add(key, now, entries, cost)
      if cost ~= 1 then
        rcall('ZREM', key, log_marker)
      elseif mark and unit then
        -- Every entry left costs 1 (those out of the window just left).
        rcall('ZADD', key, '-inf', log_marker)
      end
      rcall('PEXPIRE', key, ttl_ms(window))
      return seq -- for a refund (lua/refund.lua): log_members(now, seq, cost)
    end
  end
  return log_denied(key, now, limit, window, cost, cutoff, foreign)
end
