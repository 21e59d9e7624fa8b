-- Token bucket (twin of src/algorithm/token_bucket.rs), in units: capacity
-- and cost in units, rate in units per microsecond. The state is the
-- bucket's theoretical arrival time (TAT), tat + frac / rate µs: the instant
-- it is full again; it is missing (TAT − now) × rate units, and holds
-- capacity minus that, at least 0. PX = until the TAT.
--
-- The value is the TAT (tat_value in common.lua): one integer for a rate up
-- to 44, a string above. A TAT of rate 1 (whole µs) is read under any
-- quota, and one of rate r under every quota of rate r: a quota change
-- carries the time until full over (as GCRA does), so lowering a quota
-- never hands out a fresh bucket. A TAT of another rate above 1, or a
-- value of another form, counts as none (a full bucket).
-- dispatch.lua's check_plain repeats the rate-1 short case below, inline,
-- for a request whose tiers are all such buckets: keep the two in step.

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

-- The units short of full at `now` of the stored value v under `rate`, or
-- nil when v is not read under it (another rate above 1, another form).
local function bucket_read(v, rate, now)
  local tat, frac, r = tat_read(v)
  if not tat or (r ~= rate and r ~= 1) then return nil end
  return bucket_missing(rate, tat, frac, now)
end

-- The value of a bucket `missing` units short of full at `now`.
local function bucket_value(rate, missing, now)
  if rate == 1 then return int(now + missing) end
  local whole = div_floor(missing, rate)
  return tat_value(now + whole, missing - whole * rate, rate)
end

-- Writes a bucket `missing` units short of full at `now`; PX = until full.
local function bucket_write(key, rate, missing, now)
  redis.call('SET', key, bucket_value(rate, missing, now), 'PX', ttl_ms(div_ceil(missing, rate)))
end

-- short (the tier flag +8, see dispatch.lua): answer only the units the
-- bucket was short of full at `now`, as `remaining`; the client derives
-- the rest (src/backend/redis/wire/mod.rs), so no division is done here.
local function token_bucket(key, now, capacity, rate, unit, _, cost_tokens, v, short)
  local cost = cost_tokens * unit
  if short and rate == 1 then
    -- The commonest case written out (no helper calls): rate 1, a short
    -- reply, and no value or an integer TAT.
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
  local missing = 0
  if v then missing = bucket_read(v, rate, now) or 0 end
  local tokens = capacity - missing
  if tokens < 0 then tokens = 0 end
  if cost <= tokens then
    local left = tokens - cost
    local value = bucket_value(rate, capacity - left, now)
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

-- A key listed again in one call (flag +4, dispatch.lua): charged on v,
-- what the earlier listing stored, only if it still fits, else what is
-- there stays (twin of Limit::charge): the value, PX and undo value (the
-- tokens left), or nil and the undo of no charge (a full bucket's: its
-- refund gives nothing back).
local function token_bucket_charge(key, now, capacity, rate, unit, p4, cost_tokens, v, _)
  local allowed, _, _, _, _, value, px, left =
    token_bucket(key, now, capacity, rate, unit, p4, cost_tokens, v, false)
  if allowed == 1 then return value, px, left end
  return nil, nil, capacity
end
