-- Floor: sliding window counter, all or nothing over KEYS
-- (perf/redis_floors.sh). Key i: ARGV[3i-2] the limit, ARGV[3i-1] the
-- window (µs), ARGV[3i] b = isqrt(window) (above the limit); the value is
-- "<current window start µs + previous count × b + current count>" (the
-- layer's stored format). Cost 1. Returns { now_us, then per key the
-- weighted count before this request (× window), negative - 1 when it
-- denies }.
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local vals = redis.call('MGET', unpack(KEYS))
local out, new, px, ok = { now }, {}, {}, true
for i = 1, #KEYS do
  local a = 3 * i - 2
  local limit, window, b = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local start = now - now % window
  local prev, cur, x = 0, 0, tonumber(vals[i])
  if x then
    local s = x - x % window
    local packed = x - s
    if s == start then
      prev = math.floor(packed / b)
      cur = packed - prev * b
    elseif s + window == start then
      prev = packed % b
    end
  end
  local est = prev * (window - (now - start)) + cur * window
  if est + window > limit * window then
    ok = false
    out[i + 1] = -est - 1
  else
    out[i + 1] = est
    new[i] = start + prev * b + cur + 1
    px[i] = math.ceil((start + 2 * window - now) / 1000)
  end
end
if ok then
  for i = 1, #KEYS do
    redis.call('SET', KEYS[i], string.format('%d', new[i]), 'PX', px[i])
  end
end
return out
