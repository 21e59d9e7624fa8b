-- Token bucket (twin of src/algorithm/token_bucket.rs), in units: capacity
-- and cost in units, rate in units per microsecond. The state is the
-- bucket's theoretical arrival time (TAT), tat + frac / rate µs: the instant
-- it is full again; it is missing (TAT − now) × rate units, and holds
-- capacity minus that, at least 0. PX = until the TAT.
--
-- Values (docs/redis.md, "Stored values"):
--   compact "<tat µs><ddd>", an integer, when rate = 1 (whole µs) and unit =
--           a × 10^e with 1 <= a <= 49, e <= 9: ddd = 10a + e (unit_code);
--           else "<tat µs>:<frac>:<rate>:<unit>"
--   legacy  "<tokens in units>:<updated µs>:<unit>", read with its own rules
--           (those of every earlier release, so a mixed fleet agrees)
-- A value written under another unit or rate (the quota changed) counts as
-- none.

-- The three-digit code of a unit in the integer form, as a string ("013"
-- for 1 000), or false. Units are
-- few (one per quota), so the codes are kept: as a Redis Function
-- (FUNCTION LOAD) the table lives as long as the library, so each unit's
-- code is computed once per Redis, not on every call.
local unit_codes, unit_codes_n = {}, 0

local function unit_code(unit)
  local code = unit_codes[unit]
  if code ~= nil then return code end
  local a, e = unit, 0
  while e < 9 and a - div_floor(a, 10) * 10 == 0 do
    a = div_floor(a, 10)
    e = e + 1
  end
  code = false
  if a <= 49 then code = string.format('%03d', a * 10 + e) end
  if unit_codes_n >= 1024 then unit_codes, unit_codes_n = {}, 0 end
  unit_codes[unit] = code
  unit_codes_n = unit_codes_n + 1
  return code
end

-- The TAT (µs and remainder) of a compact value written under this unit and
-- rate, or nil.
local function bucket_tat(v, unit, rate)
  -- The common case first, without a pattern: this quota's integer value.
  local code = rate == 1 and unit_code(unit)
  if code and string.sub(v, -3) == code then
    local tat = tonumber(string.sub(v, 1, -4))
    if tat then return tat, 0 end
  end
  local tat = split_code(v)
  if tat then return nil end -- an integer value of another quota
  local t, f, r, u = string.match(v, '^(%d+):(%d+):(%d+):(%d+)$')
  if t and tonumber(r) == rate and tonumber(u) == unit then
    return tonumber(t), tonumber(f)
  end
  return nil
end

-- The units a bucket whose TAT is tat + frac / rate µs is short of full at
-- `now`: above the capacity only if the clock went back (at most 2^52, so
-- the arithmetic stays exact).
local function bucket_missing(rate, tat, frac, now)
  if tat < now then return 0 end
  local d = tat - now
  local most = 4503599627370496
  if rate > 1 then most = div_floor(most, rate) end
  if d > most then d = most end
  return d * rate + frac
end

-- The value of a bucket `missing` units short of full at `now`: compact,
-- or legacy with `updated`.
local function bucket_value(compact, capacity, rate, unit, missing, updated, now)
  if not compact then
    return string.format('%d:%d:%d', capacity - missing, updated, unit)
  end
  local code = rate == 1 and unit_code(unit)
  if code then return int(now + missing) .. code end
  local whole = div_floor(missing, rate)
  return string.format('%d:%d:%d:%d', now + whole, missing - whole * rate, rate, unit)
end

-- The units short of full at `now` (and the legacy value's `updated`, for
-- a legacy write) of the stored value v, by its format; 0 for none.
local function bucket_read(v, capacity, rate, unit, now)
  if not v then return 0, now end
  local tat, frac = bucket_tat(v, unit, rate)
  if tat then return bucket_missing(rate, tat, frac, now), now end
  local t, u, un = string.match(v, '^(%d+):(%d+):(%d+)$')
  if not t or tonumber(un) ~= unit then return 0, now end
  t, u = tonumber(t), tonumber(u)
  local elapsed = now - u
  if elapsed < 0 then elapsed = 0 end
  local full_in = div_ceil(capacity - t, rate)
  if elapsed > full_in then elapsed = full_in end
  local tokens = t + elapsed * rate
  if tokens > capacity then tokens = capacity end
  if u > now then return capacity - tokens, u end
  return capacity - tokens, now
end

-- Writes a bucket `missing` units short of full at `now`: compact, or
-- legacy with `updated`; PX = until full.
local function bucket_write(key, compact, capacity, rate, unit, missing, updated, now)
  redis.call('SET', key, bucket_value(compact, capacity, rate, unit, missing, updated, now),
    'PX', ttl_ms(div_ceil(missing, rate)))
end

local function token_bucket(key, now, capacity, rate, unit, _, cost_tokens, v, compact)
  local cost = cost_tokens * unit
  local missing, updated = bucket_read(v, capacity, rate, unit, now)
  local tokens = capacity - missing
  if tokens < 0 then tokens = 0 end
  if cost <= tokens then
    local left = tokens - cost
    local reset = div_ceil(capacity - left, rate)
    -- The wait before another request of this cost would pass (the local
    -- deny cache answers it until then; see dispatch.lua).
    local next_in = 0
    if cost > left and cost <= capacity then next_in = div_ceil(cost - left, rate) end
    -- The write (value, PX) and the undo value for a refund (lua/refund.lua).
    return 1, div_floor(left, unit), reset, next_in, 0,
      bucket_value(compact, capacity, rate, unit, capacity - left, updated, now), ttl_ms(reset), left
  end
  local reset = div_ceil(missing, rate)
  local retry = reset
  if cost <= capacity then retry = div_ceil(cost + missing - capacity, rate) end
  return 0, div_floor(tokens, unit), reset, retry, 0, nil
end
