-- Per-key demand, fleet-wide (src/observe/demand/): one instance's counts
-- since its last flush, in groups (one a tier, plan and period), each added
-- to its period's per-key totals; each total raised becomes the key's peak
-- of the hour. One call a flush, whatever the number of groups (every key
-- is in the hash slot `{demand}`).
--
-- ARGV[1] the hour's TTL (s); ARGV[2] k, the keys an hour's sample keeps;
-- ARGV[3] the most names an hour keeps
-- then per group g (its five keys are KEYS[5g-4 .. 5g]):
--   the period hash's TTL (ms), requests not sampled on the instance, n
--   (its key counts), m (its names), then n triples (key hash, count,
--   score), then m pairs (key hash, name)
-- KEYS per group: the period's totals (hash: key hash -> total), the
-- hour's peaks (hash: key hash -> the highest total), the hour's numbers
-- (hash: requests, unsampled, full), the hour's names (hash: key hash ->
-- key part), the hour's sample (sorted set: key hash by its top 52 bits)
-- Returns the requests added, over all groups.
--
-- The sample is a bottom-k by hash: the k keys of the hour with the
-- smallest hashes, the same keys whatever the instance or the order.
local hour_ttl = ARGV[1]
local k = tonumber(ARGV[2])
local max_names = tonumber(ARGV[3])
local all = 0
local a, g = 4, 0
while ARGV[a] do
  local K = {
    KEYS[5 * g + 1], KEYS[5 * g + 2], KEYS[5 * g + 3], KEYS[5 * g + 4], KEYS[5 * g + 5],
  }
  local period_ttl = ARGV[a]
  local unsampled = tonumber(ARGV[a + 1])
  local n = tonumber(ARGV[a + 2])
  local m = tonumber(ARGV[a + 3])
  local c0 = a + 4
  local requests = 0
  local full = false
  local held = redis.call('ZCARD', K[5])
  for i = 0, n - 1 do
    local f = ARGV[c0 + 3 * i]
    local c = tonumber(ARGV[c0 + 1 + 3 * i])
    local score = ARGV[c0 + 2 + 3 * i]
    requests = requests + c
    local peak = redis.call('HGET', K[2], f)
    if peak then
      local total = redis.call('HINCRBY', K[1], f, c)
      if total > tonumber(peak) then
        redis.call('HSET', K[2], f, total)
      end
    elseif held < k then
      local total = redis.call('HINCRBY', K[1], f, c)
      redis.call('ZADD', K[5], score, f)
      redis.call('HSET', K[2], f, total)
      held = held + 1
    else
      -- Full: the key replaces the sample's largest hash if it is smaller
      -- (only sampled keys have totals: the period hash stays bounded).
      full = true
      local top = redis.call('ZRANGE', K[5], -1, -1, 'WITHSCORES')
      local above = tonumber(score) > tonumber(top[2])
        or (tonumber(score) == tonumber(top[2]) and f > top[1])
      if not above then
        redis.call('ZREM', K[5], top[1])
        redis.call('HDEL', K[2], top[1])
        local total = redis.call('HINCRBY', K[1], f, c)
        redis.call('ZADD', K[5], score, f)
        redis.call('HSET', K[2], f, total)
      end
    end
  end
  if n > 0 then
    redis.call('PEXPIRE', K[1], period_ttl)
    redis.call('EXPIRE', K[2], hour_ttl)
    redis.call('EXPIRE', K[5], hour_ttl)
  end
  if requests > 0 then
    redis.call('HINCRBY', K[3], 'requests', requests)
  end
  if unsampled > 0 then
    redis.call('HINCRBY', K[3], 'unsampled', unsampled)
  end
  if full then
    redis.call('HSET', K[3], 'full', 1)
  end
  if requests > 0 or unsampled > 0 then
    redis.call('EXPIRE', K[3], hour_ttl)
  end
  local names = redis.call('HLEN', K[4])
  local wrote = false
  for j = c0 + 3 * n, c0 + 3 * n + 2 * m - 1, 2 do
    if names < max_names and redis.call('HSETNX', K[4], ARGV[j], ARGV[j + 1]) == 1 then
      names = names + 1
      wrote = true
    end
  end
  if wrote then
    redis.call('EXPIRE', K[4], hour_ttl)
  end
  all = all + requests
  a = c0 + 3 * n + 2 * m
  g = g + 1
end
return all
