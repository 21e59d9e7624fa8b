-- A tier's penalty box (twin of src/algorithm/penalty/mod.rs), checked as a
-- tier of its own right after the tier it guards, on the key
-- "<tier key>{pb}" (same hash slot). Unlike the rate algorithms it WRITES
-- when the request is denied: a denial by its tier is a strike, and the
-- strike that completes `violations` within `window` starts a block of
-- block × backoff^(offences − 1) (at most max_block; an offence within
-- `memory` after the END of the last block repeats). While blocked it denies every
-- request, Retry-After = the block's end, and counts no strike.
--
-- p1 = violations + 1024 × backoff + 2^20 × memory (whole seconds),
-- p2 = window_us, p3 = block_us, p4 = max_block_us.
-- Value "<blocked until µs>:<offences>:<last block µs>:<strike µs>,...";
-- PX = until it means nothing (block, strikes in the window, memory).

-- Whether the check just before (the guarded tier) allowed the request:
-- set by check_request (dispatch.lua) after every tier.
local penalty_tier_allowed = true

local function penalty_read(v)
  if not v then return 0, 0, 0, {} end
  local b, o, l, list = string.match(v, '^(%d+):(%d+):(%d+):([%d,]*)$')
  if not b then return 0, 0, 0, {} end
  local strikes = {}
  for t in string.gmatch(list, '%d+') do strikes[#strikes + 1] = tonumber(t) end
  return tonumber(b), tonumber(o), tonumber(l), strikes
end

local function penalty_commit() return 0 end

local function penalty(key, now, packed, window, block, max_block, _, v, _)
  local memory = div_floor(packed, 1048576)
  local rest = packed - memory * 1048576
  memory = memory * 1000000
  local backoff = div_floor(rest, 1024)
  local violations = rest - backoff * 1024
  local blocked, offences, last_block, strikes = penalty_read(v)
  if blocked > now then
    return 0, 0, blocked - now, blocked - now, 0, nil
  end
  if penalty_tier_allowed then
    return 1, violations, 0, 0, 0, penalty_commit
  end
  -- A strike.
  local kept = {}
  for _, t in ipairs(strikes) do
    if t + window > now then kept[#kept + 1] = t end
  end
  kept[#kept + 1] = now
  local memory_left = 0
  if offences > 0 and blocked + memory > now then memory_left = blocked + memory - now end
  if #kept < violations then
    local ttl = kept[1] + window - now
    if ttl < memory_left then ttl = memory_left end
    local list = {}
    for i, t in ipairs(kept) do list[i] = int(t) end
    rcall('SET', key, int(blocked) .. ':' .. int(offences) .. ':' .. int(last_block) .. ':' .. table.concat(list, ','), 'PX', ttl_ms(ttl))
    return 1, violations, 0, 0, 0, penalty_commit
  end
  -- The block.
  if offences > 0 and blocked + memory > now then
    offences = offences + 1
  else
    offences = 1
  end
  local len = block
  for _ = 2, offences do
    len = len * backoff
    if len >= max_block then break end
  end
  if len > max_block then len = max_block end
  local ttl = len + memory
  rcall('SET', key, int(now + len) .. ':' .. int(offences) .. ':' .. int(now) .. ':', 'PX', ttl_ms(ttl))
  return 0, 0, len, len, 0, nil
end

-- Nothing to give back (lua/cluster.lua's refund mode): a penalty box is
-- never charged.
local function penalty_refund() end
