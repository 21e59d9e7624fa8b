-- Sliding window log (twin of src/algorithm/sliding_window_log.rs).
-- A sorted set: score = admission time (µs), member = "<time>:<seq>:<cost>".
-- An entry counts while now < time + window. PX = one window after the
-- newest entry. Denied requests are not logged.
local function sliding_window_log(key, now, limit, window, _, _, cost)
  local cutoff = now - window
  -- A key of another type (the algorithm changed) is no state; the commit
  -- deletes it before logging.
  local live = redis.pcall('ZRANGEBYSCORE', key, '(' .. int(cutoff), '+inf', 'WITHSCORES')
  local foreign = type(live) == 'table' and live.err ~= nil
  if foreign then live = {} end
  local used, newest = 0, nil
  local times, costs = {}, {}
  for i = 1, #live, 2 do
    local c = tonumber(string.match(live[i], ':(%d+)$')) or 1
    local t = tonumber(live[i + 1])
    used = used + c
    times[#times + 1] = t
    costs[#costs + 1] = c
    if newest == nil or t > newest then newest = t end
  end
  if used + cost <= limit then
    return 1, limit - used - cost, window, 0, 0, function()
      if foreign then redis.call('DEL', key) end
      redis.call('ZREMRANGEBYSCORE', key, '-inf', int(cutoff))
      local seq = #times
      local member = int(now) .. ':' .. seq .. ':' .. int(cost)
      while redis.call('ZSCORE', key, member) do
        seq = seq + 1
        member = int(now) .. ':' .. seq .. ':' .. int(cost)
      end
      redis.call('ZADD', key, int(now), member)
      redis.call('PEXPIRE', key, ttl_ms(window))
      return seq -- for a refund (lua/refund.lua): the member is now:seq:cost
    end
  end
  local reset = 0
  if newest then reset = newest + window - now end
  local retry = reset
  if cost <= limit then
    local need = used + cost - limit
    local freed = 0
    for i = 1, #times do
      freed = freed + costs[i]
      if freed >= need then
        retry = times[i] + window - now
        break
      end
    end
  end
  local remaining = limit - used
  if remaining < 0 then remaining = 0 end
  return 0, remaining, reset, retry, 0, nil
end
