-- Floor: sliding window log, all or nothing over KEYS
-- (perf/redis_floors.sh). Key i: ARGV[2i-1] the limit, ARGV[2i] the window
-- (µs); a sorted set of admission times (score and member: the time in
-- µs). Per key: entries out of the window removed, then counted; when
-- every key allows, one ZADD and one PEXPIRE per key. Cost 1. Returns
-- { now_us, then per key the count before this request, -(count + 1) when
-- it denies }.
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local out, ok = { now }, true
for i = 1, #KEYS do
  local limit, window = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now - window)
  local count = redis.call('ZCARD', KEYS[i])
  if count >= limit then
    ok = false
    out[i + 1] = -count - 1
  else
    out[i + 1] = count
  end
end
if ok then
  local member = string.format('%d', now)
  for i = 1, #KEYS do
    redis.call('ZADD', KEYS[i], member, member)
    redis.call('PEXPIRE', KEYS[i], math.ceil(tonumber(ARGV[2 * i]) / 1000))
  end
end
return out
