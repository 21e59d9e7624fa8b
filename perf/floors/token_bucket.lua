-- Floor: token bucket as GCRA, all or nothing over KEYS
-- (perf/redis_floors.sh; the shape of `bench_server minimal4-lua`, with a
-- reply per key). Key i: ARGV[2i-1] the interval of one token (µs),
-- ARGV[2i] the capacity (burst × interval, µs); the value is the
-- theoretical arrival time (µs, the layer's stored format at rate 1).
-- Cost 1. Returns { now_us, then per key the µs the bucket was short of
-- full, -(that + 1) when it denies }.
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local vals = redis.call('MGET', unpack(KEYS))
local out, new, ok = { now }, {}, true
for i = 1, #KEYS do
  local tat = tonumber(vals[i]) or now
  if tat < now then tat = now end
  local after = tat + tonumber(ARGV[2 * i - 1])
  if after - now > tonumber(ARGV[2 * i]) then
    ok = false
    out[i + 1] = now - tat - 1
  else
    out[i + 1] = tat - now
    new[i] = after
  end
end
if ok then
  for i = 1, #KEYS do
    redis.call('SET', KEYS[i], string.format('%d', new[i]), 'PX', math.ceil((new[i] - now) / 1000))
  end
end
return out
