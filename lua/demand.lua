-- Per-key demand, fleet-wide (src/observe/demand/): one instance's counts
-- of one tier (and plan) in one period, added to the period's per-key
-- totals; each total raised becomes the key's peak of the hour.
--
-- KEYS[1] the period's totals (hash: key hash -> total)
-- KEYS[2] the hour's peaks (hash: key hash -> the highest total)
-- KEYS[3] the hour's numbers (hash: requests, unsampled)
-- KEYS[4] the hour's names (hash: key hash -> key part)
-- KEYS[5] the hour's sample (sorted set: key hash by its top 52 bits)
-- ARGV[1] the period hash's TTL (ms); ARGV[2] the hour's TTL (s)
-- ARGV[3] k, the keys an hour's sample keeps; ARGV[4] the most names
-- ARGV[5] requests not sampled on the instance; ARGV[6] n
-- then n triples (key hash, count, score), then pairs (key hash, name)
--
-- The sample is a bottom-k by hash: the k keys of the hour with the
-- smallest hashes, the same keys whatever the instance or the order.
local n = tonumber(ARGV[6])
local k = tonumber(ARGV[3])
local requests = 0
local unsampled = tonumber(ARGV[5])
local full = false
local held = redis.call('ZCARD', KEYS[5])
for i = 0, n - 1 do
  local f = ARGV[7 + 3 * i]
  local c = tonumber(ARGV[8 + 3 * i])
  local score = ARGV[9 + 3 * i]
  requests = requests + c
  local peak = redis.call('HGET', KEYS[2], f)
  if peak then
    local total = redis.call('HINCRBY', KEYS[1], f, c)
    if total > tonumber(peak) then
      redis.call('HSET', KEYS[2], f, total)
    end
  elseif held < k then
    local total = redis.call('HINCRBY', KEYS[1], f, c)
    redis.call('ZADD', KEYS[5], score, f)
    redis.call('HSET', KEYS[2], f, total)
    held = held + 1
  else
    -- Full: the key replaces the sample's largest hash if it is smaller
    -- (only sampled keys have totals: the period hash stays bounded).
    full = true
    local top = redis.call('ZRANGE', KEYS[5], -1, -1, 'WITHSCORES')
    local above = tonumber(score) > tonumber(top[2])
      or (tonumber(score) == tonumber(top[2]) and f > top[1])
    if not above then
      redis.call('ZREM', KEYS[5], top[1])
      redis.call('HDEL', KEYS[2], top[1])
      local total = redis.call('HINCRBY', KEYS[1], f, c)
      redis.call('ZADD', KEYS[5], score, f)
      redis.call('HSET', KEYS[2], f, total)
    end
  end
end
if n > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
  redis.call('EXPIRE', KEYS[5], ARGV[2])
end
if requests > 0 then
  redis.call('HINCRBY', KEYS[3], 'requests', requests)
end
if unsampled > 0 then
  redis.call('HINCRBY', KEYS[3], 'unsampled', unsampled)
end
if full then
  redis.call('HSET', KEYS[3], 'full', 1)
end
if requests > 0 or unsampled > 0 then
  redis.call('EXPIRE', KEYS[3], ARGV[2])
end
local names = redis.call('HLEN', KEYS[4])
local max_names = tonumber(ARGV[4])
local wrote = false
for j = 7 + 3 * n, #ARGV, 2 do
  if names < max_names and redis.call('HSETNX', KEYS[4], ARGV[j], ARGV[j + 1]) == 1 then
    names = names + 1
    wrote = true
  end
end
if wrote then
  redis.call('EXPIRE', KEYS[4], ARGV[2])
end
return requests
