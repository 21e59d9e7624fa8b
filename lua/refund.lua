-- Refunds: the inverse of each algorithm's charge, run through the 'refund'
-- mode of lua/cluster.lua (on a cluster node, or on a single Redis). On a
-- Redis Cluster a request whose tiers live in several hash slots is charged
-- optimistically on every slot at once; when another slot's enforced tier
-- denied it, the slots that did charge run these to give the charge back
-- (see docs/redis.md, "Redis Cluster"). On both, a tier with
-- skip_failed_requests / skip_successful_requests runs them once the
-- response's status is known. Twins: Limit::refund in src/algorithm/mod.rs.
-- Joined in the cluster script only (CLUSTER_LUA: after the algorithm files,
-- before dispatch.lua); the refunds of concurrency (the slot released),
-- the penalty box and an override's read (nothing to give back) are in
-- their own files, and cluster.lua lists all nine by algorithm id (calendar_refund gives a
-- calendar window's charge back through the fixed window's window_refund).
--
-- Each takes the key, the refund's clock `now`, the charge's clock
-- `charged_at` (µs, the `now` the charging script ran at), the algorithm's
-- parameters p1..p4 and cost as in check.lua, and `undo`: what the charge
-- returned (token bucket: tokens left in units; leaky bucket: backlog after
-- the charge in ticks; sliding log: the member's sequence number; fixed
-- window and sliding window counter: nothing).
--
-- Rule: give back what this charge still takes away, never more. Refill or
-- a new window may already have absorbed part of it (the bucket would have
-- been full, or the window is over, even without the charge); that part is
-- not given back, so a refund can never admit more than the request had
-- never been charged at all. A value of another quota or another window is
-- left alone (a value in the home forms is the tier's configured quota's:
-- a bucket's p4, a fixed window's or counter's p3, is that quota's unit or
-- window when the tier's quota is another, else 0; a value a refund
-- changes keeps its form). When a refund leaves the "nothing stored"
-- state (full bucket, empty window), the key is deleted, exactly as if the
-- charge had never happened.

-- A tier key's value may hold its candidates' pack after its live value
-- and a '\0' (docs/redis.md, "Stored values"): a refund or a debt reads
-- the live value alone (refund_get, which keeps the rest in refund_rest)
-- and writes the pack back after whatever it writes (refund_set: the live
-- value, or false for "nothing stored"; px nil keeps the TTL), the key
-- living no shorter than it did.
local refund_rest = false
local function refund_get(key)
  local v = rcall('GET', key)
  refund_rest = false
  if not v then return v end
  local z = string.find(v, '\0', 1, true)
  if not z then return v end
  refund_rest = string.sub(v, z)
  if z == 1 then return false end
  return string.sub(v, 1, z - 1)
end
local function refund_set(key, value, px)
  if refund_rest then
    value = (value or '') .. refund_rest
    if px then
      local left = rcall('PTTL', key)
      if left > px then px = left end
    end
  elseif not value then
    rcall('DEL', key)
    return
  end
  if px then
    rcall('SET', key, value, 'PX', px)
  else
    rcall('SET', key, value, 'KEEPTTL')
  end
end

-- A window's charge given back (fixed and calendar windows): the charge's
-- window is [start, start + window); home, when the tier's quota is not
-- its configured one, that quota's window length (a value in the home
-- forms is then of another window, left alone).
local function window_refund(key, start, window, limit, cost, home)
  local v = refund_get(key)
  if not v then return end
  local s, c, e = string.match(v, '^(%d+):(%d+):(%d+)$')
  local count
  if s then
    if tonumber(s) ~= start or tonumber(e) ~= start + window then return end
    count = tonumber(c)
  elseif home and home ~= window then
    return
  else
    count = window_count(v, start, start, start + window)
  end
  if count == 0 then return end
  count = count - cost
  if count <= 0 then
    refund_set(key, false)
  else
    local tag
    if s then tag = start + window end
    refund_set(key, window_value(limit, window, start, count, tag))
  end
end

local function fixed_window_refund(key, _, charged_at, limit, window, home, _, cost, _)
  if home == 0 then home = nil end
  window_refund(key, div_floor(charged_at, window) * window, window, limit, cost, home)
end

local function calendar_refund(key, _, charged_at, limit, b0, b1, b2, cost, _)
  local start, window = calendar_window(charged_at, b0, b1, b2)
  window_refund(key, start, window, limit, cost, nil)
end

local function sliding_window_log_refund(key, _, charged_at, _, _, _, _, cost, seq)
  -- Both names the charge may have used; removing the last member deletes
  -- the key, and so does removing the last entry beside the marker (the
  -- marker's reverse rank is the number of entries).
  local short, long = log_members(charged_at, seq, cost)
  local removed
  if short then
    removed = rcall('ZREM', key, short, long)
  else
    removed = rcall('ZREM', key, long)
  end
  if removed == 1 and rcall('ZREVRANK', key, log_marker) == 0 then
    rcall('DEL', key)
  end
end

local function sliding_window_counter_refund(key, _, charged_at, limit, window, home, _, cost, _)
  if home == 0 then home = nil end
  local start = div_floor(charged_at, window) * window
  local v = refund_get(key)
  if not v then return end
  local s, c, p, w = counter_read(v, home or window)
  if not s or w ~= window then return end
  if s == start then
    c = c - cost
    if c < 0 then c = 0 end
  elseif s == start + window then
    -- A later request opened the next window: this charge is in `previous`.
    p = p - cost
    if p < 0 then p = 0 end
  else
    return
  end
  if c == 0 and p == 0 then
    refund_set(key, false)
  else
    refund_set(key, counter_value(limit, window, home, s, c, p))
  end
end

-- A bucket's stored TAT (tat, frac) if v was written under the quota
-- (rate, unit) of a tier whose configured unit is hunit (0: this one),
-- and whether it is in the tagged form; nil for another quota's.
local function tat_of_quota(v, rate, unit, hunit)
  local tat, frac, r, u = tat_read(v)
  if not tat or r ~= rate then return nil end
  if u then
    if u ~= unit then return nil end
    return tat, frac, true
  end
  if hunit ~= 0 and hunit ~= unit then return nil end
  return tat, frac, false
end

local function token_bucket_refund(key, now, charged_at, capacity, rate, unit, hunit, cost_tokens, left)
  local cost = cost_tokens * unit
  -- Without this charge the bucket would have been full (cost - back units
  -- of it absorbed by the cap) after (capacity - left - cost) / rate µs.
  local elapsed = now - charged_at
  if elapsed < 0 then elapsed = 0 end
  local full_in = div_ceil(capacity, rate)
  if elapsed > full_in then elapsed = full_in end
  local back = capacity - left - elapsed * rate
  if back > cost then back = cost end
  if back <= 0 then return end
  local v = refund_get(key)
  if not v then return end
  -- Refill to now exactly as token_bucket() does, then add back.
  local tat, frac, tagged = tat_of_quota(v, rate, unit, hunit)
  if not tat then return end
  local missing = bucket_missing(rate, unit, tat, frac, rate, unit, now) - back
  if missing <= 0 then
    refund_set(key, false)
  else
    refund_set(key, bucket_value(rate, unit, tagged, missing, now),
      ttl_ms(div_ceil(missing, rate)))
  end
end

local function leaky_bucket_refund(key, now, charged_at, _, rate, unit, hunit, cost_tokens, after)
  local cost = cost_tokens * unit
  -- Without this charge the backlog would have drained (cost - back ticks
  -- of it absorbed by the empty bucket) after (after - cost) / rate µs.
  local elapsed = now - charged_at
  if elapsed < 0 then elapsed = 0 end
  local drained_in = div_ceil(after, rate)
  if elapsed > drained_in then elapsed = drained_in end
  local back = after - elapsed * rate
  if back > cost then back = cost end
  if back <= 0 then return end
  local v = refund_get(key)
  if not v then return end
  local tat, frac, tagged = tat_of_quota(v, rate, unit, hunit)
  if not tat or tat < now then return end
  local backlog = (tat - now) * rate + frac - back
  if backlog <= 0 then
    refund_set(key, false)
  else
    refund_set(key, leaky_value(now, backlog, rate, unit, tagged),
      ttl_ms(div_ceil(backlog, rate)))
  end
end

-- Debts (twins: Limit::debt in src/algorithm/settle.rs): a priced request's
-- actual cost above its estimate, charged once its response ended, whatever
-- the state. The 'refund' mode of lua/cluster.lua runs one for a negative
-- cost (-extra). The tier may go below zero: a token bucket more than its
-- capacity short of full (at most 2^52 units; every request denied, with
-- the exact wait, until refill repays it), a fixed window counting above
-- its limit until the window ends. The client clamps `extra` so that every
-- value stays exact (below 2^53).

local function fixed_window_debt(key, now, limit, window, home, _, extra)
  if home == 0 then home = nil end
  local start = div_floor(now, window) * window
  local count = 0
  local v = refund_get(key)
  if v then count = window_count(v, now, home_window(now, home or window)) end
  count = count + extra
  if count > 4503599627370496 then count = 4503599627370496 end
  local value
  if home then
    value = format('%d:%d:%d', start, count, start + window)
  elseif limit < window and count < window then
    value = int(start + count)
  else
    -- A debt may count past the window's length: the long form.
    value = format('%d:%d', start, count)
  end
  refund_set(key, value, ttl_ms(start + window - now))
end

local function token_bucket_debt(key, now, _, rate, unit, hunit, extra)
  if hunit == 0 then hunit = nil end
  local missing = 0
  local v = refund_get(key)
  if v then missing = bucket_read(v, rate, unit, hunit or unit, now) or 0 end
  missing = missing + extra * unit
  if missing > 4503599627370496 then missing = 4503599627370496 end
  if missing <= 0 then return end
  refund_set(key, bucket_value(rate, unit, hunit, missing, now),
    ttl_ms(div_ceil(missing, rate)))
end
