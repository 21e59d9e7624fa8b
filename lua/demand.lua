-- Per-key demand, fleet-wide (src/observe/demand/): one instance's counts
-- of one tier (and plan) in one period, added to the period's per-key
-- totals; each total raised becomes the key's peak of the hour.
--
-- KEYS[1] the period's totals (hash: key hash -> total)
-- KEYS[2] the hour's peaks (hash: key hash -> the highest total)
-- KEYS[3] the hour's numbers (hash: requests, unsampled)
-- KEYS[4] the hour's names (hash: key hash -> key part)
-- ARGV[1] the period hash's TTL (ms); ARGV[2] the hour's TTL (s)
-- ARGV[3] the most keys an hour keeps; ARGV[4] the most names
-- ARGV[5] requests not sampled on the instance; ARGV[6] n
-- then n pairs (key hash, count), then pairs (key hash, name)
local n = tonumber(ARGV[6])
local max_keys = tonumber(ARGV[3])
local requests = 0
local unsampled = tonumber(ARGV[5])
local held = redis.call('HLEN', KEYS[2])
for i = 0, n - 1 do
  local f = ARGV[7 + 2 * i]
  local c = tonumber(ARGV[8 + 2 * i])
  requests = requests + c
  local total = redis.call('HINCRBY', KEYS[1], f, c)
  local peak = redis.call('HGET', KEYS[2], f)
  if peak then
    if total > tonumber(peak) then
      redis.call('HSET', KEYS[2], f, total)
    end
  elseif held < max_keys then
    redis.call('HSET', KEYS[2], f, total)
    held = held + 1
  else
    unsampled = unsampled + c
  end
end
if n > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
end
if requests > 0 then
  redis.call('HINCRBY', KEYS[3], 'requests', requests)
end
if unsampled > 0 then
  redis.call('HINCRBY', KEYS[3], 'unsampled', unsampled)
end
if requests > 0 or unsampled > 0 then
  redis.call('EXPIRE', KEYS[3], ARGV[2])
end
local names = redis.call('HLEN', KEYS[4])
local max_names = tonumber(ARGV[4])
local wrote = false
for j = 7 + 2 * n, #ARGV, 2 do
  if names < max_names and redis.call('HSETNX', KEYS[4], ARGV[j], ARGV[j + 1]) == 1 then
    names = names + 1
    wrote = true
  end
end
if wrote then
  redis.call('EXPIRE', KEYS[4], ARGV[2])
end
return requests
