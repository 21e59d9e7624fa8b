-- Floor: leaky bucket (policing), all or nothing over KEYS
-- (perf/redis_floors.sh). Key i: ARGV[2i-1] the drain time of one request
-- (µs), ARGV[2i] the capacity (µs of backlog); the value is the instant the
-- backlog drains (µs, the layer's stored format at rate 1). Cost 1.
-- Returns { now_us, then per key the backlog before this request (µs),
-- -(backlog + 1) when it denies }.
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local vals = redis.call('MGET', unpack(KEYS))
local out, new, ok = { now }, {}, true
for i = 1, #KEYS do
  local backlog = (tonumber(vals[i]) or now) - now
  if backlog < 0 then backlog = 0 end
  local after = backlog + tonumber(ARGV[2 * i - 1])
  if after > tonumber(ARGV[2 * i]) then
    ok = false
    out[i + 1] = -backlog - 1
  else
    out[i + 1] = backlog
    new[i] = after
  end
end
if ok then
  for i = 1, #KEYS do
    redis.call('SET', KEYS[i], string.format('%d', now + new[i]), 'PX', math.ceil(new[i] / 1000))
  end
end
return out
