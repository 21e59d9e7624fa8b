-- Group commit, leaner (perf/group_commit.sh, issue 43): the decisions of
-- perf/floors/fixed_window_batch.lua with the per-key costs cut, to see
-- how far a group-committed script can go. ARGV[1] = R rules, then R pairs
-- (limit, window µs), then one string per request: a digit per key, its
-- rule (1-9). KEYS: the requests' keys in the same order. One TIME and one
-- MGET for the call; a rule's window start and end are computed once; a
-- key read in the current window is charged with INCRBY '1' (its expiry
-- stands), any other with SET ... PXAT the window's end (no number
-- formatted per key); a key written earlier in the call is read from the
-- call's own table. Reply as the floor: { now_us, a count or -(count + 1)
-- per key }.
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
local vals = redis.call('MGET', unpack(KEYS))
local out, written, rule, cnt = { now }, {}, {}, {}
local j = 0
for a = 2 * nr + 2, #ARGV do
  local s = ARGV[a]
  local n, ok = #s, true
  for i = 1, n do
    local r = s:byte(i) - 48
    local key = KEYS[j + i]
    local x = written[key] or tonumber(vals[j + i])
    local count = 0
    if x and x >= start[r] then count = x - start[r] end
    rule[i], cnt[i] = r, count
    if count >= limit[r] then
      ok = false
      out[j + i + 1] = -count - 1
    else
      out[j + i + 1] = count
    end
  end
  if ok then
    for i = 1, n do
      local key, r, c = KEYS[j + i], rule[i], cnt[i]
      if c > 0 then
        redis.call('INCRBY', key, '1')
      else
        redis.call('SET', key, string.format('%d', start[r] + 1), 'PXAT', pxat[r])
      end
      written[key] = start[r] + c + 1
    end
  end
  j = j + n
end
return out
