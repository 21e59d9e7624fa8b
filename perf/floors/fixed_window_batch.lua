-- Floor with group commit: fixed window, B requests in one call, each all
-- or nothing over its own keys (perf/group_commit.sh, an experiment for
-- issue 43). ARGV[1] = B; then per request: its key count n, then n pairs
-- (limit, window µs). KEYS: the requests' keys in the same order. One Redis
-- TIME for the call; per request one MGET of its keys (so a key shared by
-- two requests of the batch is read after the earlier one's write), one
-- SET ... PX per key when all its keys allow. Stored value and reply as
-- perf/floors/fixed_window.lua: { now_us, then per key of every request in
-- order the count before the request, -(count + 1) when it denies }.
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local out, new, px = { now }, {}, {}
local o, a, k = 1, 2, 0
for _ = 1, tonumber(ARGV[1]) do
  local n = tonumber(ARGV[a])
  a = a + 1
  local vals = redis.call('MGET', unpack(KEYS, k + 1, k + n))
  local ok = true
  for i = 1, n do
    local limit, window = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
    a = a + 2
    local start = now - now % window
    local count, x = 0, tonumber(vals[i])
    if x and x >= start then count = x - start end
    o = o + 1
    if count >= limit then
      ok = false
      out[o] = -count - 1
    else
      out[o] = count
      new[i] = start + count + 1
      px[i] = math.ceil((start + window - now) / 1000)
    end
  end
  if ok then
    for i = 1, n do
      redis.call('SET', KEYS[k + i], string.format('%d', new[i]), 'PX', px[i])
    end
  end
  k = k + n
end
return out
