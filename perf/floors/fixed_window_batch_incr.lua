-- Group commit, increment first (perf/group_commit.sh, issue 43): the
-- decisions of perf/floors/fixed_window_batch.lua with no read. Arguments
-- as perf/floors/fixed_window_batch_lean.lua (ARGV[1] = R rules, R pairs
-- (limit, window µs), then a string per request: a digit per key, its
-- rule). Per key one INCRBY '1', whose reply is the stored value
-- (<window start µs + count>) already counted; a value not above the
-- window start (a new key: 1, or last window's) is set to start + 1 with
-- PXAT the window's end. A request with a key over its limit is undone
-- (DECRBY '1' on each of its keys: inside the script nobody sees the
-- charge), so it stays all or nothing. Reply as the floor: { now_us, a
-- count before the request or -(count + 1) per key }.
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local nr = tonumber(ARGV[1])
local limit, start, pxat = {}, {}, {}
for r = 1, nr do
  local w = tonumber(ARGV[2 * r + 1])
  limit[r] = tonumber(ARGV[2 * r])
  start[r] = now - now % w
  pxat[r] = string.format('%d', (start[r] + w) / 1000)
end
local out = { now }
local j = 0
for a = 2 * nr + 2, #ARGV do
  local s = ARGV[a]
  local n, ok = #s, true
  for i = 1, n do
    local r = s:byte(i) - 48
    local key = KEYS[j + i]
    local v = redis.call('INCRBY', key, '1')
    if v <= start[r] then
      v = start[r] + 1
      redis.call('SET', key, string.format('%d', v), 'PXAT', pxat[r])
    end
    local count = v - start[r] - 1
    if count >= limit[r] then
      ok = false
      out[j + i + 1] = -count - 1
    else
      out[j + i + 1] = count
    end
  end
  if not ok then
    for i = 1, n do redis.call('DECRBY', KEYS[j + i], '1') end
  end
  j = j + n
end
return out
