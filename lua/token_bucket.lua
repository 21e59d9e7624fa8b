-- Token bucket (twin of src/algorithm/token_bucket.rs), in units: capacity
-- and cost in units, rate in units per microsecond. The state is the
-- bucket's theoretical arrival time (TAT), tat + frac / rate µs: the instant
-- it is full again; it is missing (TAT − now) × rate units, and holds
-- capacity minus that, at least 0. PX = until the TAT.
--
-- Values (docs/redis.md, "Stored values"):
--   compact "<tat µs>", an integer, when rate = 1 (the TAT in whole µs);
--           else "<tat µs>:<frac>:<rate>:<unit>"
--   legacy  "<tokens in units>:<updated µs>:<unit>", read with its own rules
--           (those of every earlier release, so a mixed fleet agrees)
-- An integer TAT is read under any quota: a quota change carries the time
-- until full over (as GCRA does), so lowering a quota never hands out a
-- fresh bucket. An integer of 19 digits or more (>= 10^18; a TAT in µs has
-- 16) is "<tat µs><ddd>", the earlier compact value, whose three digits
-- named the quota: read as its TAT (the code dropped). A
-- string of another unit or rate counts as none.

-- The TAT (µs and remainder) of a compact value read under this unit and
-- rate, or nil.
local function bucket_tat(v, unit, rate)
  -- The common case first, without a pattern: an integer.
  local n = tonumber(v)
  if n then
    if n < 1e18 then return n, 0 end
    return tonumber(string.sub(v, 1, -4)), 0
  end
  local t, f, r, u = string.match(v, '^(%d+):(%d+):(%d+):(%d+)$')
  if t and tonumber(r) == rate and tonumber(u) == unit then
    return tonumber(t), tonumber(f)
  end
  return nil
end

-- The units a bucket whose TAT is tat + frac / rate µs is short of full at
-- `now`: above the capacity only if the clock went back or the TAT was
-- written under another quota, further from full (at most 2^52, so the
-- arithmetic stays exact).
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
  if rate == 1 then return int(now + missing) end
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

-- short (the tier flag +8, see dispatch.lua): answer only the units the
-- bucket was short of full at `now`, as `remaining`; the client derives
-- the rest (src/backend/redis/wire/mod.rs), so no division is done here.
local function token_bucket(key, now, capacity, rate, unit, _, cost_tokens, v, compact, short)
  local cost = cost_tokens * unit
  if short and compact and rate == 1 then
    -- The commonest case written out (no helper calls): rate 1, a short
    -- reply, the compact format, and no value or an integer TAT.
    local tat = 0
    if v then tat = tonumber(v) end
    if tat and tat < 1e18 then
      local missing = 0
      if tat > now then
        missing = tat - now
        if missing > 4503599627370496 then missing = 4503599627370496 end
      end
      local tokens = capacity - missing
      if tokens < 0 then tokens = 0 end
      if cost > tokens then return 0, missing, 0, 0, 0, nil end
      -- The value: full again in capacity - left µs; PX: that in whole ms,
      -- rounded up (ttl_ms).
      local full_in = capacity - (tokens - cost)
      local a = full_in + 999
      local ms = math.floor(a / 1000)
      if ms * 1000 > a then ms = ms - 1 end
      if ms < 1 then ms = 1 end
      return 1, missing, 0, 0, 0, string.format('%d', now + full_in), ms + ttl_slack_ms, 0
    end
  end
  local missing, updated = bucket_read(v, capacity, rate, unit, now)
  local tokens = capacity - missing
  if tokens < 0 then tokens = 0 end
  if cost <= tokens then
    local left = tokens - cost
    local value = bucket_value(compact, capacity, rate, unit, capacity - left, updated, now)
    if short then
      local full_in = capacity - left
      if rate > 1 then full_in = div_ceil(full_in, rate) end
      return 1, missing, 0, 0, 0, value, ttl_ms(full_in), 0
    end
    local reset = div_ceil(capacity - left, rate)
    -- The wait before another request of this cost would pass (the local
    -- deny cache answers it until then; see dispatch.lua).
    local next_in = 0
    if cost > left and cost <= capacity then next_in = div_ceil(cost - left, rate) end
    -- The write (value, PX) and the undo value for a refund (lua/refund.lua).
    return 1, div_floor(left, unit), reset, next_in, 0, value, ttl_ms(reset), left
  end
  if short then return 0, missing, 0, 0, 0, nil end
  local reset = div_ceil(missing, rate)
  local retry = reset
  if cost <= capacity then retry = div_ceil(cost + missing - capacity, rate) end
  return 0, div_floor(tokens, unit), reset, retry, 0, nil
end
