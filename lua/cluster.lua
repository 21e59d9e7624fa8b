-- The Redis Cluster entry point (src/backend/redis/cluster.rs): the tiers of
-- one request that share a hash slot, in one script call; or the refund of
-- a charge made by such a call (a single Redis runs this script for its
-- refunds too). Joined after the shared files, refund.lua and dispatch.lua
-- (CLUSTER_LUA; the order: common.lua), instead of check.lua.
--
-- ARGV[1]   'check' or 'refund'
-- ARGV[2]   the clock, as ARGV[1] of check.lua: "" = Redis TIME, or a test
--           clock "<now µs>[:<ttl slack ms>]" (a "-<deadline µs>" would be
--           honoured too; the cluster client sends none)
--
-- check:    KEYS and one spec per tier from ARGV[3] on, exactly as in
--           check.lua (algorithm 1..9, p1, p2, p3, p4, cost, flags), with the
--           same commit rule among these tiers.
--   returns the same reply as check.lua (check_request in dispatch.lua; the
--           layout is documented in src/backend/redis/wire/mod.rs). The client
--           sets the undo flag on every tier: a slot that charged while
--           another slot denied is refunded with those values.
-- refund:   KEYS = the keys to refund (tiers this script charged), eight
--           ARGV per key from ARGV[3] on: algorithm, p1, p2, p3, p4, cost,
--           charged_at (the now_us the check returned), undo. A negative
--           cost is a priced request's debt (-cost charged whatever the
--           state: token_bucket_debt, fixed_window_debt in refund.lua). An
--           override's read (algorithm 8) makes the next key's refund or
--           debt run under the override it reads (lua/override.lua), as in
--           a check.
--   returns the number of keys refunded.

local refunds = {
  fixed_window_refund, sliding_window_log_refund, sliding_window_counter_refund,
  token_bucket_refund, leaky_bucket_refund, concurrency_refund, penalty_refund,
  override_refund, calendar_refund,
}

local debts = { [1] = fixed_window_debt, [4] = token_bucket_debt }

if ARGV[1] == 'refund' then
  local now = read_clock(ARGV[2])
  for i = 1, #KEYS do
    local a = 3 + (i - 1) * 8
    local alg = tonumber(ARGV[a])
    local cost = tonumber(ARGV[a + 5])
    -- An override's read (algorithm 8) before its tier's refund: the
    -- refund runs under the key's override, as the check did.
    local p1, p2, p3, p4 = override_params(alg, tonumber(ARGV[a + 1]),
      tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]))
    -- The home suffix (refund.lua: a bucket's p4, a fixed window's or
    -- counter's p3, 0 at the configured quota) of the quota it runs under:
    -- an override's keeps the tier's configured unit or window.
    if alg == 4 or alg == 5 then
      local home = tonumber(ARGV[a + 4])
      if home == 0 then home = tonumber(ARGV[a + 3]) end
      if p3 == home then p4 = 0 else p4 = home end
    elseif alg == 1 or alg == 3 then
      local home = tonumber(ARGV[a + 3])
      if home == 0 then home = tonumber(ARGV[a + 2]) end
      if p2 == home then p3 = 0 else p3 = home end
    end
    if alg == 8 then
      override_read(KEYS[i], now)
    elseif cost < 0 then
      local debt = debts[alg]
      if not debt then
        return redis.error_reply('no debt for algorithm ' .. tostring(ARGV[a]))
      end
      debt(KEYS[i], now, p1, p2, p3, p4, -cost)
    else
      local refund = refunds[alg]
      if not refund then
        return redis.error_reply('unknown algorithm ' .. tostring(ARGV[a]))
      end
      refund(KEYS[i], now, tonumber(ARGV[a + 6]), p1, p2, p3, p4, cost,
        tonumber(ARGV[a + 7]))
    end
  end
  return #KEYS
end

if ARGV[1] ~= 'check' then
  return redis.error_reply('unknown mode ' .. tostring(ARGV[1]))
end

local out, err = check_request(ARGV[2], 3, #KEYS)
if not out then
  return redis.error_reply(err)
end
return out
