-- Floor: calendar window, all or nothing over KEYS (perf/redis_floors.sh):
-- a fixed window between boundaries the app computed. Key i: ARGV[4i-3]
-- the limit, ARGV[4i-2..4i] three boundaries b0 < b1 < b2 (epoch µs, now in
-- [b0, b2)); the window is [b0, b1) before b1, else [b1, b2). Value, cost
-- and reply as perf/floors/fixed_window.lua.
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local vals = redis.call('MGET', unpack(KEYS))
local out, new, px, ok = { now }, {}, {}, true
for i = 1, #KEYS do
  local a = 4 * i - 3
  local limit, start, stop = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  if now >= stop then start, stop = stop, tonumber(ARGV[a + 3]) end
  local count, x = 0, tonumber(vals[i])
  if x and x >= start then count = x - start end
  if count >= limit then
    ok = false
    out[i + 1] = -count - 1
  else
    out[i + 1] = count
    new[i] = start + count + 1
    px[i] = math.ceil((stop - now) / 1000)
  end
end
if ok then
  for i = 1, #KEYS do
    redis.call('SET', KEYS[i], string.format('%d', new[i]), 'PX', px[i])
  end
end
return out
