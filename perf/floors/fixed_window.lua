-- Floor: fixed window, all or nothing over KEYS (perf/redis_floors.sh).
-- Only what the algorithm needs: Redis TIME as the clock, one MGET, one
-- SET ... PX per key when every key allows. Key i: ARGV[2i-1] the limit,
-- ARGV[2i] the window (µs, above the limit); the value is "<window start
-- µs + count>" (the layer's stored format). Cost 1. Returns { now_us, then
-- per key the count before this request, -(count + 1) when it denies }: the
-- client derives remaining and reset from them.
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local vals = redis.call('MGET', unpack(KEYS))
local out, new, px, ok = { now }, {}, {}, true
for i = 1, #KEYS do
  local limit, window = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
  local start = now - now % window
  local count, x = 0, tonumber(vals[i])
  if x and x >= start then count = x - start end
  if count >= limit then
    ok = false
    out[i + 1] = -count - 1
  else
    out[i + 1] = count
    new[i] = start + count + 1
    px[i] = math.ceil((start + window - now) / 1000)
  end
end
if ok then
  for i = 1, #KEYS do
    redis.call('SET', KEYS[i], string.format('%d', new[i]), 'PX', px[i])
  end
end
return out
