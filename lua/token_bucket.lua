-- Token bucket (twin of src/algorithm/token_bucket.rs), in units: capacity
-- and cost in units, rate in units per microsecond. The state is the
-- bucket's theoretical arrival time (TAT), tat + frac / rate µs: the instant
-- it is full again; it is missing (TAT − now) × rate units, and holds
-- capacity minus that, at least 0. PX = until the TAT.
--
-- The value is the TAT and the quota it was written under (tat_value in
-- common.lua): one integer for a rate up to 44 under the tier's configured
-- unit (`home`: nil when the tier's quota is its configured one, else that
-- quota's unit, from the spec's home suffix), a string otherwise. Read
-- under another quota, the tokens it is short of full carry over into the
-- new quota's units (carry_units): a quota change never hands out a fresh
-- bucket, nor takes one away.
-- dispatch.lua's check_plain repeats the rate-1 short case below, inline,
-- for a request whose tiers are all such buckets: keep the two in step.

-- The units short of full at `now`, in units of `unit` per token and rate
-- `rate`, of a TAT tat + frac / r µs written under r units per µs and u
-- per token: exact under the same quota; under another, its tokens carried
-- over, rounded up. Above the capacity only if the clock went back or the
-- TAT was written under a quota with more tokens missing (at most 2^52, so
-- the arithmetic stays exact).
local function bucket_missing(rate, unit, tat, frac, r, u, now)
  if tat < now then return 0 end
  local d = tat - now
  local most = 4503599627370496
  if r > 1 then most = div_floor(most, r) end
  if d > most then d = most end
  if r == rate and u == unit then return d * rate + frac end
  return carry_units(d * r + frac, u, unit)
end

-- The units short of full at `now` of the stored value v under the quota
-- (rate, unit) of a tier whose configured unit is hunit, or nil when v is
-- not a bucket's value; and whether v was written under another quota
-- (its used capacity carried over: see carried_value).
local function bucket_read(v, rate, unit, hunit, now)
  local tat, frac, r, u = tat_read(v)
  if not tat then return nil end
  u = u or hunit
  return bucket_missing(rate, unit, tat, frac, r, u, now), r ~= rate or u ~= unit
end

-- The value of a bucket `missing` units short of full at `now`; `home`
-- (not nil) tags it with its unit (tat_value).
local function bucket_value(rate, unit, home, missing, now)
  if rate == 1 and not home then return int(now + missing) end
  local whole = div_floor(missing, rate)
  if home then return tat_value(now + whole, missing - whole * rate, rate, unit) end
  return tat_value(now + whole, missing - whole * rate, rate)
end

-- short (the tier flag +8, see dispatch.lua): answer only the units the
-- bucket was short of full at `now`, as `remaining`; the client derives
-- the rest (src/backend/redis/wire/mod.rs), so no division is done here.
local function token_bucket(key, now, capacity, rate, unit, _, cost_tokens, v, short, home)
  local cost = cost_tokens * unit
  if short and rate == 1 and not home then
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
      local ms = floor(a / 1000)
      if ms * 1000 > a then ms = ms - 1 end
      if ms < 1 then ms = 1 end
      return 1, missing, 0, 0, 0, format('%d', now + full_in), ms + ttl_slack_ms, 0
    end
  end
  local missing, moved = 0, false
  if v then
    missing, moved = bucket_read(v, rate, unit, home or unit, now)
    missing = missing or 0
  end
  -- Carried over a quota change: the bucket as it is now under this quota,
  -- stored whatever the decision (dispatch.lua; Limit::carry in the twin).
  local cv, cpx
  if moved and missing > 0 then
    cv, cpx = bucket_value(rate, unit, home, missing, now), ttl_ms(div_ceil(missing, rate))
  end
  local tokens = capacity - missing
  if tokens < 0 then tokens = 0 end
  if cost <= tokens then
    local left = tokens - cost
    local value = bucket_value(rate, unit, home, capacity - left, now)
    if short then
      local full_in = capacity - left
      if rate > 1 then full_in = div_ceil(full_in, rate) end
      return 1, missing, 0, 0, 0, value, ttl_ms(full_in), 0, cv, cpx
    end
    local reset = div_ceil(capacity - left, rate)
    -- The wait before another request of this cost would pass (the local
    -- deny cache answers it until then; see dispatch.lua).
    local next_in = 0
    if cost > left and cost <= capacity then next_in = div_ceil(cost - left, rate) end
    -- The write (value, PX) and the undo value for a refund (lua/refund.lua).
    return 1, div_floor(left, unit), reset, next_in, 0, value, ttl_ms(reset), left, cv, cpx
  end
  if short then return 0, missing, 0, 0, 0, nil, nil, nil, cv, cpx end
  local reset = div_ceil(missing, rate)
  local retry = reset
  if cost <= capacity then retry = div_ceil(cost + missing - capacity, rate) end
  return 0, div_floor(tokens, unit), reset, retry, 0, nil, nil, nil, cv, cpx
end

-- A key listed again in one call (flag +4, dispatch.lua): charged on v,
-- what the earlier listing stored, only if it still fits, else what is
-- there stays (twin of Limit::charge): the value, PX and undo value (the
-- tokens left), or nil and the undo of no charge (a full bucket's: its
-- refund gives nothing back).
local function token_bucket_charge(key, now, capacity, rate, unit, p4, cost_tokens, v, _, home)
  local allowed, _, _, _, _, value, px, left =
    token_bucket(key, now, capacity, rate, unit, p4, cost_tokens, v, false, home)
  if allowed == 1 then return value, px, left end
  return nil, nil, capacity
end
