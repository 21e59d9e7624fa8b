-- Token bucket for every tier of one request, all or nothing.
--
-- The Lua twin of src/algorithm/token_bucket.rs: same integer arithmetic,
-- exact in Lua doubles because every value stays below 2^53 (capacity is
-- capped at 2^52 units when the quota is built).
--
-- KEYS[i]      bucket key of tier i: "<prefix>:<tier>:<key part>"
-- ARGV[1]      "" to read the clock with Redis TIME (production), or a test
--              clock in Unix epoch microseconds (ManualClock; tests only)
-- ARGV[2+4(i-1)..5+4(i-1)], for tier i:
--              capacity (units), rate (units per microsecond),
--              unit (units per token), cost (tokens)
--
-- Stored value: "<tokens in units>:<updated, epoch microseconds>", with a
-- PX time-to-live equal to the time until the bucket is full again (a missing
-- key and a full bucket mean the same).
--
-- Returns { now_us, then for each tier: allowed (0/1), remaining (tokens),
--           reset_after_us, retry_after_us }.
-- A request is charged on every tier only if every tier allows it.

local function div_floor(a, b)
  local q = math.floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

local function div_ceil(a, b)
  return div_floor(a + b - 1, b)
end

local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local n = #KEYS
local out = { now }
local writes = {}
local all = true

for i = 1, n do
  local a = 2 + (i - 1) * 4
  local capacity = tonumber(ARGV[a])
  local rate = tonumber(ARGV[a + 1])
  local unit = tonumber(ARGV[a + 2])
  local cost = tonumber(ARGV[a + 3]) * unit

  local tokens, updated = capacity, now
  local stored = redis.call('GET', KEYS[i])
  if stored then
    local t, u = string.match(stored, '^(%d+):(%d+)$')
    if t then
      t = tonumber(t)
      u = tonumber(u)
      local elapsed = now - u
      if elapsed < 0 then elapsed = 0 end
      local full_in = div_ceil(capacity - t, rate)
      if elapsed > full_in then elapsed = full_in end
      tokens = t + elapsed * rate
      if tokens > capacity then tokens = capacity end
      if u > now then updated = u end
    end
  end

  if cost <= tokens then
    local left = tokens - cost
    local reset_after = div_ceil(capacity - left, rate)
    out[#out + 1] = 1
    out[#out + 1] = div_floor(left, unit)
    out[#out + 1] = reset_after
    out[#out + 1] = 0
    writes[i] = { left, updated, reset_after }
  else
    all = false
    local reset_after = div_ceil(capacity - tokens, rate)
    local retry_after
    if cost > capacity then
      retry_after = reset_after
    else
      retry_after = div_ceil(cost - tokens, rate)
    end
    out[#out + 1] = 0
    out[#out + 1] = div_floor(tokens, unit)
    out[#out + 1] = reset_after
    out[#out + 1] = retry_after
  end
end

if all then
  for i = 1, n do
    local w = writes[i]
    local ttl_ms = div_ceil(w[3], 1000)
    if ttl_ms < 1 then ttl_ms = 1 end
    redis.call('SET', KEYS[i], string.format('%.0f:%.0f', w[1], w[2]), 'PX', ttl_ms)
  end
end

return out
