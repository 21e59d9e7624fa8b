-- The dispatcher, shared by every entry point: check.lua (a single Redis,
-- as a script or as the Function's body), cluster.lua (one hash slot of a
-- cluster), peek.lua and slot.lua. Joined after the algorithm files (and
-- refund.lua in the cluster script), right before the entry point (the
-- order: common.lua). It holds the algorithms by id (a spec's first number,
-- 1..9, listed at tier_spec), the clock argument (read_clock), the one MGET
-- (read_states), the spec cache (tier_spec), check_plain (the written-out
-- check of a request whose tiers are all enforced rate-1 token buckets
-- with the short reply) and check_request (the check of any request; it
-- tries check_plain first).

local algorithms = {
  fixed_window, sliding_window_log, sliding_window_counter, token_bucket, leaky_bucket,
  concurrency, penalty, override, calendar,
}

-- A key listed again in one call (flag +4): each listing is decided on the
-- key's state before the call, and when all allow, charged in turn, each
-- on what the listings before it stored (as the model and the memory
-- backend charge). An algorithm whose write is a SET of a value computed
-- from the state read before the call needs its charge made again on the
-- value just stored: these. (The sliding log's and the concurrency tier's
-- writes act on the key as it is then; a penalty box and an override's
-- read are never charged.)
local charges_again = {
  [fixed_window] = fixed_window_charge,
  [sliding_window_counter] = sliding_window_counter_charge,
  [token_bucket] = token_bucket_charge,
  [leaky_bucket] = leaky_bucket_charge,
  [calendar] = calendar_charge,
}

-- The write of a key listed again (t[11]: its charge again): read what the
-- listings before it stored, and store that charged (or, for a token
-- bucket that no longer fits, leave it). Returns this charge's undo value
-- (a repeated tier is never sent short, so it reaches the trailer).
local function charge_again(t, key, now)
  return function()
    -- A key an earlier listing of another type wrote (a sliding log's
    -- sorted set) reads as no value, as MGET read it, not as an error.
    local v = redis.pcall('GET', key)
    if type(v) == 'table' then v = false end
    local value, px, undo = t[11](key, now, t[2], t[3], t[4], t[5], t[6], v, t[9], t[14])
    if value then rcall('SET', key, value, 'PX', px) end
    return undo
  end
end

-- The clock argument: "" reads Redis TIME; "-<deadline µs>" (a negative
-- number: one tonumber, no string slicing, on every production call) reads
-- Redis TIME and also returns the deadline; "<µs>[:<ttl slack ms>]" is a
-- test clock (ManualClock; tests only). Returns now (µs) and the deadline,
-- if any. Also resets the TTL slack, which outlives a call in a Redis
-- Function.
local function read_clock(arg)
  ttl_slack_ms = 0
  override_next = false
  local deadline
  if arg ~= '' then
    local n = tonumber(arg)
    if n == nil or n >= 0 then
      local clock, slack = string.match(arg, '^(%d+):?(%d*)$')
      if slack ~= nil and slack ~= '' then ttl_slack_ms = tonumber(slack) end
      return tonumber(clock), nil
    end
    deadline = -n
  end
  local t = rcall('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2]), deadline
end

-- The stored values of KEYS[1..n], in one MGET (one command however many
-- tiers; a sorted-set key of the sliding log reads as false, and that
-- algorithm reads its set itself).
local function read_states(n)
  if n == 0 then return {} end
  return rcall('MGET', unpack(KEYS, 1, n))
end

-- A tier's spec: ONE argument, "<algorithm> <p1> <p2> <p3> <p4> <cost>
-- <flags>" (integers separated by single spaces; algorithm 1 fixed window,
-- 2 sliding window log, 3 sliding window counter, 4 token bucket, 5 leaky
-- bucket, 6 concurrency, 7 penalty box, 8 override read, 9 calendar
-- window; flags: +1 shadow,
-- +2 undo wanted, +4 repeat: the key was listed before in this call
-- (charges_again above; the bit once chose the stored format, of which
-- there is now one, in scripts of other versions), +8 short reply: a token
-- or leaky bucket, a fixed or calendar window answers one number, its
-- state, instead of three; a sliding log without +2, its remaining when
-- it allows; +16 candidate, of the live check numbered floor(flags / 32)
-- in the call: see check_request). A spec may end with a home suffix, " <h1>[ <h2> <h3>]":
-- the tier's quota is not its configured one (a quota changed at run time,
-- a plan's), whose values in the home forms it must read: h1 the configured
-- unit (token and leaky buckets) or window length (fixed window, sliding
-- window counter), h1..h3 the configured calendar's three boundaries.
-- Kept as t[14] (nil without a suffix); the tier then writes the tagged
-- forms (docs/redis.md, "Stored values") and is never plain. A spec may
-- then carry its candidates' pack: " c " and the pack's spec (pack_spec;
-- t[20], see tier_spec).
-- Parsed specs are kept by their string: loaded as a Redis Function the
-- table lives as long as the library, so a request's tiers cost one table
-- lookup each instead of seven tonumber() calls (a deployment has a few
-- specs per tier: one per cost). At most 1 024 are kept.
local specs, specs_n = {}, 0

-- The parsed spec s, { algorithm function, p1, p2, p3, p4, cost, shadow,
-- undo, short, plain, charge again (repeat), b }, or false for a malformed
-- spec or an unknown algorithm. plain: the kind of tier check_plain decides
-- written out (false: any other): 1 an enforced token bucket of rate 1
-- with the short reply, 2 an enforced fixed window, 3 an enforced
-- calendar window, 4 an enforced sliding window counter (t[12] its b,
-- isqrt(window), computed once here), 5 an enforced policing leaky bucket
-- of rate 1 with the short reply, 6 an enforced sliding log of cost 1
-- listed once in the call whose undo value (its entry's seq, in the
-- trailer) is not asked for, 7 any other enforced sliding log whose undo
-- value is not asked for (decided by its function); none of the others
-- listed again in the call.
-- A pack of candidate quotas' spec (candidate_pack; src/backend/redis/
-- wire/args.rs, PackSpec): "10 <live> <k>" then seven numbers per
-- candidate, "<algorithm> <p1> <p2> <p3> <p4> <cost> <tag>": live, the
-- position (from 1) of their tier's live check in the call; each candidate
-- a token bucket of rate 1 (4), a policing leaky bucket of rate 1 (5), a
-- fixed window (1), a calendar window (9) or a sliding window counter (3).
-- As a tier: t[10] = 8 (check_plain and check_request decide it with
-- candidate_pack), t[15] its live check, t[16] the candidates, each
-- { kind as check_plain's, p1, p2, p3, p4, cost, tag }. false when
-- malformed.
local pack_kinds = { [4] = 1, [5] = 5, [1] = 2, [9] = 3, [3] = 4 }
-- The algorithms whose value is a string of one SET: the tiers that can
-- hold their candidates' pack in their own value.
local string_valued = { [token_bucket] = true, [leaky_bucket] = true, [fixed_window] = true,
  [calendar] = true, [sliding_window_counter] = true }
local function pack_spec(s)
  local n = {}
  for x in string.gmatch(s, '-?%d+') do n[#n + 1] = tonumber(x) end
  local k = n[3]
  if not k or k < 1 or k > 8 or #n ~= 3 + 7 * k or n[2] < 1 then return false end
  local c = {}
  for j = 1, k do
    local b = 3 + 7 * (j - 1)
    local kind = pack_kinds[n[b + 1]]
    if not kind then return false end
    if (kind == 1 or kind == 5) and n[b + 3] ~= 1 then return false end
    if kind == 5 and n[b + 5] >= 0 then return false end
    if (kind == 2 or kind == 4) and n[b + 3] < 1 then return false end
    -- [8]: a bucket's cost in µs of its rate (cost × unit), computed once.
    c[j] = { kind, n[b + 2], n[b + 3], n[b + 4], n[b + 5], n[b + 6], n[b + 7], n[b + 6] * n[b + 4] }
  end
  local t = { false, 0, 0, 0, 0, 0, false, false, false, 8 }
  t[15], t[16] = n[2], c
  return t
end

local function tier_spec(s)
  local t = specs[s]
  if t ~= nil then return t end
  -- A live tier carrying its candidates' pack: its spec, " c ", then the
  -- pack's (src/backend/redis/wire/args.rs, `write_tier_with_pack`): the
  -- live spec's table with the pack's as t[20]; only a tier whose value
  -- is a string of one SET holds a pack (docs/redis.md, "Stored values"),
  -- and it is never decided increment-first (t[18]).
  local c = string.find(s, ' c ', 1, true)
  if c then
    local live, pack = tier_spec(string.sub(s, 1, c - 1)), pack_spec(string.sub(s, c + 3))
    t = false
    if live and pack and string_valued[live[1]] then
      t = {}
      for q, x in pairs(live) do t[q] = x end
      t[18], t[19], t[20] = nil, nil, pack
    end
    if specs_n >= 1024 then specs, specs_n = {}, 0 end
    specs[s] = t
    specs_n = specs_n + 1
    return t
  end
  if string.sub(s, 1, 3) == '10 ' then
    t = pack_spec(s)
    if specs_n >= 1024 then specs, specs_n = {}, 0 end
    specs[s] = t
    specs_n = specs_n + 1
    return t
  end
  local a, p1, p2, p3, p4, cost, flags, home =
    string.match(s, '^(%d+) (%d+) (%d+) (%d+) (-?%d+) (%d+) (%d+)(.*)$')
  local algorithm = a and algorithms[tonumber(a)]
  if home and home ~= '' then
    local h1, h2, h3 = string.match(home, '^ (%d+) ?(%d*) ?(%d*)$')
    if not h1 then
      algorithm = nil
    elseif algorithm == calendar then
      home = { tonumber(h1), tonumber(h2), tonumber(h3) }
      if not home[3] then algorithm = nil end
    else
      home = tonumber(h1)
    end
  else
    home = nil
  end
  t = false
  if algorithm then
    flags = tonumber(flags)
    t = { algorithm, tonumber(p1), tonumber(p2), tonumber(p3), tonumber(p4), tonumber(cost),
      has_flag(flags, 1), has_flag(flags, 2), has_flag(flags, 8) }
    t[14] = home
    -- A sliding log answers short only without its undo value (its seq,
    -- in the trailer).
    if t[8] and algorithm == sliding_window_log then t[9] = false end
    -- +4: the key was listed before in this call; t[11] charges it again.
    if has_flag(flags, 4) then t[11] = charges_again[algorithm] end
    -- +16: a candidate quota of the check numbered floor(flags / 32) in
    -- this call (its tier's live check); t[15] that number.
    if has_flag(flags, 16) then t[15] = floor(flags / 32) end
    local plain = false
    if not t[7] and not t[11] and not home then
      if algorithm == token_bucket and t[3] == 1 and t[9] then
        plain = 1
      elseif algorithm == fixed_window then
        plain = 2
      elseif algorithm == calendar then
        plain = 3
      elseif algorithm == sliding_window_counter then
        plain = 4
        t[12] = isqrt(t[3])
      elseif algorithm == leaky_bucket and t[3] == 1 and t[9] and t[5] < 0 then
        plain = 5
      elseif algorithm == sliding_window_log and not t[8] then
        if t[6] == 1 and not has_flag(flags, 4) then plain = 6 else plain = 7 end
        -- Its PX less the TTL slack (ttl_ms(window)).
        t[13] = ttl_ms(t[3]) - ttl_slack_ms
      end
    end
    t[10] = plain
    -- Decided increment-first (check_incr below): an enforced fixed window
    -- answering short, listed once, no candidate, stored in the integer
    -- form (limit < window: fixed_window.lua): t[18]; t[19] its cost as
    -- the string INCRBY is sent. (t[16] is a candidates pack's list:
    -- pack_spec.)
    if plain == 2 and t[9] and not t[15] and t[2] < t[3] then
      t[18], t[19] = true, format('%d', t[6])
    end
  end
  if specs_n >= 1024 then specs, specs_n = {}, 0 end
  specs[s] = t
  specs_n = specs_n + 1
  return t
end

-- The hourly sets of refused and shadow-limited keys (check.lua's
-- KEYS[n+1], KEYS[n+2]) after a call added to them: each one touched
-- (touched[1]: blocked, touched[2]: shadowed) keeps its 10 000 heaviest
-- keys and lives 25 h. Run on a denial only.
local function trim_key_sets(blocked, shadowed, touched)
  for s, set in ipairs({ blocked, shadowed }) do
    if touched[s] then
      local extra = rcall('ZCARD', set) - 10000
      if extra > 0 then rcall('ZREMRANGEBYRANK', set, 0, extra - 1) end
      rcall('EXPIRE', set, 90000)
    end
  end
end

-- PX for a key due in `us` µs: whole ms, rounded up, at least 1 (ttl_ms,
-- written out).
local function px_of(us)
  local a = us + 999
  local ms = floor(a / 1000)
  if ms * 1000 > a then ms = ms - 1 end
  if ms < 1 then ms = 1 end
  return ms + ttl_slack_ms
end

-- Increment-first, for a request whose tiers are all of t[18] (tier_spec:
-- enforced fixed windows answering short, listed once, none a candidate,
-- stored in the integer form "<window start µs + count>"): INCRBY each
-- key by its cost first (its reply is the value already charged, so no
-- read and, in a window already begun, no other write), decide on the
-- value before it; then, for an allowed request, SET each key found
-- absent or of an earlier window to its window's own value until the
-- window ends, and for a denied one undo every INCRBY (DECRBY; DEL for a
-- key it created) in the same call, so the request stays all or nothing
-- and no other command ever sees the charge. Unlike check_plain, a denial
-- writes (the INCRBY and its undo are replicated and notified).
-- Tier i is keys[k + i] with the spec args[first + i - 1]; its count
-- (short: the window's count before the request, or -(count + 1) when it
-- denies, as check_plain answers) goes to out[o + i]. Returns o + n and
-- the numbers of the tiers that denied (nil when none did), or nil with
-- nothing left written for any other request, or when a key does not hold
-- an integer (another form, another type): check_request decides it then.
-- Per key no more than the perf lab's lean script
-- (perf/floors/fixed_window_batch_incr.lua): one lookup of the spec's
-- record (incr_rec), no table made per request (`incr_seen` holds each
-- tier's record and value before, for the call's requests in turn), no
-- number formatted but on a window's first request.

-- Per spec string, its record { limit, window µs, cost, cost as INCRBY's
-- argument, window start µs, the now that start is of } (an array: the
-- fields a key reads are one indexed load each; the start is computed
-- once per spec a call), or false for a spec not of t[18]. Kept as the
-- specs are (at most 1 024).
local incr_recs, incr_recs_n = {}, 0
local function incr_rec(spec)
  local t = specs[spec]
  if t == nil then t = tier_spec(spec) end
  local rec = false
  if t and t[18] then rec = { t[2], t[3], t[6], t[19], 0, -1 } end
  if incr_recs_n >= 1024 then incr_recs, incr_recs_n = {}, 0 end
  incr_recs[spec] = rec
  incr_recs_n = incr_recs_n + 1
  return rec
end

local incr_seen = {}
-- A group commit's numbers of tiers by their strings (batch.lua).
local batch_tier_counts = {}
local function check_incr(keys, k, args, first, n, now, out, o)
  if n == 1 then
    -- One tier (the commonest request): the same, in locals.
    local spec = args[first]
    local rec = incr_recs[spec]
    if rec == nil then rec = incr_rec(spec) end
    if not rec then return nil end
    local key = keys[k + 1]
    local r = redis.pcall('INCRBY', key, rec[4])
    if type(r) ~= 'number' then return nil end
    local start = rec[5]
    if rec[6] ~= now then
      local window = rec[2]
      start = floor(now / window)
      if start * window > now then start = start - 1 end
      start = start * window
      rec[5], rec[6] = start, now
    end
    local cost = rec[3]
    local b = r - cost
    local count = b - start
    local fresh = count < 0 or count >= rec[2]
    if fresh then count = 0 end
    if count + cost <= rec[1] then
      out[o + 1] = count
      if fresh then
        rcall('SET', key, format('%d', start + cost), 'PX',
          px_of(start + rec[2] - now))
      end
      return o + 1
    end
    out[o + 1] = -count - 1
    if b == 0 then rcall('DEL', key) else rcall('DECRBY', key, rec[4]) end
    return o + 1, { 1 }
  end
  if n == 0 then return nil end
  local seen = incr_seen
  for i = 1, n do
    local spec = args[first + i - 1]
    local rec = incr_recs[spec]
    if rec == nil then rec = incr_rec(spec) end
    if not rec then return nil end
    seen[2 * i] = rec
  end
  local pcall_ = redis.pcall
  local denied, fresh = false, false
  for i = 1, n do
    local rec = seen[2 * i]
    local r = pcall_('INCRBY', keys[k + i], rec[4])
    if type(r) ~= 'number' then
      for j = i - 1, 1, -1 do
        if seen[2 * j - 1] == 0 then rcall('DEL', keys[k + j])
        else rcall('DECRBY', keys[k + j], seen[2 * j][4]) end
      end
      return nil
    end
    local start = rec[5]
    if rec[6] ~= now then
      local window = rec[2]
      start = floor(now / window)
      if start * window > now then start = start - 1 end
      start = start * window
      rec[5], rec[6] = start, now
    end
    local cost = rec[3]
    local b = r - cost
    local count = b - start
    if count < 0 or count >= rec[2] then
      count, fresh = 0, true
    end
    if count + cost <= rec[1] then
      out[o + i] = count
    else
      out[o + i] = -count - 1
      denied = true
    end
    seen[2 * i - 1] = b
  end
  if denied then
    local rejected = {}
    for i = 1, n do
      if out[o + i] < 0 then rejected[#rejected + 1] = i end
      if seen[2 * i - 1] == 0 then rcall('DEL', keys[k + i])
      else rcall('DECRBY', keys[k + i], seen[2 * i][4]) end
    end
    return o + n, rejected
  end
  if fresh then
    for i = 1, n do
      local rec = seen[2 * i]
      local start, b = rec[5], seen[2 * i - 1]
      if b < start or b >= start + rec[2] then
        -- The window's first request (the key was absent or of an earlier
        -- window): its own value, until the window ends.
        rcall('SET', keys[k + i], format('%d', start + rec[3]), 'PX',
          px_of(start + rec[2] - now))
      end
    end
  end
  return o + n
end

-- A sliding log's write from check_plain (kind 6): its entry of cost 1
-- at `now`, named `now` alone (sliding_window_log.lua: no refund ever
-- names it, since no undo value was asked for), or when another entry of
-- this µs has that name, the first free seq after `used` (the live
-- entries); with used -1 (a key found empty), the entry and the marker.
-- Then PX ms. (No NX: a member named `now` can only be an entry of this
-- µs, whose score ZADD leaves as it is, answering 0.)
local function log_write(key, now, used, px)
  local at = format('%d', now)
  if used < 0 then
    rcall('ZADD', key, at, at, '-inf', log_marker)
  elseif rcall('ZADD', key, at, at) == 0 then
    log_add(key, now, used + 1, 1)
  end
  rcall('PEXPIRE', key, px)
end

-- The candidate quotas of one tier key packed in ONE key (the spec
-- algorithm 10, see pack_spec; docs/redis.md, "Stored values"): the value
-- is binary, four little-endian doubles per candidate (struct.pack
-- '<dddd'): its tag (a hash of its name, below 2^52), then its state, a
-- bucket's TAT (µs), a window's start, count and end (µs), a sliding
-- window counter's start, current and previous counts; all zero: no
-- state. Times are below 2^53 µs, so exact in a double. Each candidate is
-- decided on its own state (found by its tag) as check_plain decides its
-- kind, in plain arithmetic: no tonumber, no string.format, no key of its
-- own. Appends each candidate's reply (short for a bucket, a fixed or
-- calendar window; long for a counter) to out after o; returns the new o,
-- the pack's value with every allowing candidate charged and its PX (the
-- longest-lived state's), or nil when none allows; and the PX of the
-- stored pack's longest-lived state (nil when none lives: the pack kept
-- as it is by a tier key that holds it, inline_write).
-- In a tier key's value (candidate_inline, check_plain), z is the
-- position of the '\0' the pack follows (0: the value holds none) and the
-- value ends with one more byte, the number of states (the pack it
-- returns has it too); else z is nil and the pack is the whole value.
-- pre: the live value the returned value starts with (then a '\0', packed
-- by struct's 's' with the states: one string made, not two joined), or
-- false for the decisions alone (no value returned).
-- The new pack's numbers, reused by every call (no table per call).
local pack_out = {}
local pack_formats = { '<dddd', '<dddddddd', '<dddddddddddd', '<dddddddddddddddd',
  [-1] = '<ddddB', [-2] = '<ddddddddB', [-3] = '<ddddddddddddB', [-4] = '<ddddddddddddddddB' }
local prefixed_formats = { '<sddddB', '<sddddddddB', '<sddddddddddddB', '<sddddddddddddddddB' }
local function candidate_pack(t, v, now, out, o, z, pre)
  local c = t[16]
  local k = #c
  -- The stored states: m of them, each read where it is, by its tag (a
  -- value of another form, or no string, reads as no state), from base.
  local m, base = 0, 0
  if z then
    if z > 0 then m, base = (#v - z - 1) / 32, z end
  elseif type(v) == 'string' and #v % 32 == 0 and #v <= 256 then
    m = #v / 32
  end
  local new = pack_out
  local any, latest, stored = false, 0, 0
  -- new[w]: the tag of candidate j's state (w = 4j - 3).
  local w = -3
  for j = 1, k do
    local e = c[j]
    local kind, tag = e[1], e[7]
    local a, b, x = 0, 0, 0
    if m > 0 then
      -- Its own place first (the same candidates in the same order).
      local found, sa, sb, sx
      if j <= m then
        found, sa, sb, sx = struct.unpack('<dddd', v, base + 32 * j - 31)
      end
      if found ~= tag then
        found = nil
        for r = 1, m do
          if r ~= j then
            local g, ra, rb, rx = struct.unpack('<dddd', v, base + 32 * r - 31)
            if g == tag then found, sa, sb, sx = g, ra, rb, rx; break end
          end
        end
      end
      if found then
        a, b, x = sa, sb, sx
        -- Until when the stored state lives (as until_us below).
        local u = 0
        if kind == 1 or kind == 5 then
          u = a
        elseif kind == 4 then
          if b > 0 then u = a + 2 * e[3] elseif x > 0 then u = a + e[3] end
        elseif b > 0 then
          u = x
          if kind == 3 then u = u + 60000000 end
        end
        if u > stored then stored = u end
      end
    end
    w = w + 4
    new[w] = tag
    if kind == 1 then
      -- A token bucket of rate 1 (the commonest: its own branch, the
      -- fewest VM instructions): a = its TAT.
      local capacity, cost = e[2], e[8]
      local missing = 0
      if a > now then
        missing = a - now
        if missing > 4503599627370496 then missing = 4503599627370496 end
      end
      local tokens = capacity - missing
      if tokens < 0 then tokens = 0 end
      o = o + 1
      if cost <= tokens then
        out[o] = missing
        a = now + (capacity - tokens + cost)
        any = true
      else
        out[o] = -missing - 1
      end
      new[w + 1], new[w + 2], new[w + 3] = a, 0, 0
      if a > latest then latest = a end
    else
      local until_us = 0
      if kind == 5 then
        -- A policing leaky bucket of rate 1: a = its TAT.
        local capacity, cost = e[2], e[8]
        local missing = 0
        if a > now then missing = a - now end
        local after = missing + cost
        if cost <= capacity and after <= capacity then
          out[o + 1] = missing
          a = now + after
          any = true
        else
          out[o + 1] = -missing - 1
        end
        o = o + 1
        until_us = a
      elseif kind == 4 then
        -- A sliding window counter: a start, b current, x previous count.
        local limit, window, cost = e[2], e[3], e[6]
        local start = floor(now / window)
        if start * window > now then start = start - 1 end
        start = start * window
        local prev, cur = 0, 0
        if a == start then
          prev, cur = x, b
        elseif a + window == start then
          prev = b
        end
        local cap = limit * window
        local est = prev * (window - (now - start)) + cur * window
        if est + cost * window <= cap then
          local reset = start + 2 * window - now
          if cur + cost == 0 then reset = counter_reset(start, window, prev, 0, now) end
          local left = cap - est - cost * window
          out[o + 1], out[o + 2], out[o + 3] = div_floor(left, window), reset, 0
          a, b, x = start, cur + cost, prev
          any = true
        else
          -- sliding_window_counter's denial, written out.
          local reset = counter_reset(start, window, prev, cur, now)
          local retry
          if cost > limit then
            retry = reset
          elseif cur + cost <= limit then
            retry = start + window - div_floor((limit - cost - cur) * window, prev) - now
          else
            local wait = 0
            if cur > 0 then
              wait = window - div_floor((limit - cost) * window, cur)
              if wait < 0 then wait = 0 end
            end
            retry = start + window + wait - now
          end
          local left = cap - est
          if left < 0 then left = 0 end
          out[o + 1], out[o + 2], out[o + 3] = -div_floor(left, window) - 1, reset, retry
        end
        o = o + 3
        if b > 0 then until_us = a + 2 * window elseif x > 0 then until_us = a + window end
      else
        -- A fixed window (kind 2) or a calendar window (kind 3): a start,
        -- b count, x end.
        local limit, start, window, margin = e[2], nil, nil, 0
        if kind == 2 then
          window = e[3]
          start = floor(now / window)
          if start * window > now then start = start - 1 end
          start = start * window
        else
          start, window = calendar_window(now, e[3], e[4], e[5])
          margin = 60000000
        end
        local count = 0
        if a == start and x == start + window then count = b end
        local after = count + e[6]
        if after <= limit then
          out[o + 1] = count
          a, b, x = start, after, start + window
          any = true
        else
          out[o + 1] = -count - 1
        end
        o = o + 1
        if b > 0 then until_us = x + margin end
      end
      new[w + 1], new[w + 2], new[w + 3] = a, b, x
      if until_us > latest then latest = until_us end
    end
  end
  local stored_px
  if stored > now then stored_px = px_of(stored - now) end
  if not any or pre == false then return o, nil, nil, stored_px end
  if pre then
    local f = prefixed_formats[k]
    if not f then f = '<s' .. string.rep('d', 4 * k) .. 'B'; prefixed_formats[k] = f end
    new[4 * k + 1] = k
    -- px_of(latest - now), written out.
    local us = latest - now + 999
    local ms = floor(us / 1000)
    if ms * 1000 > us then ms = ms - 1 end
    if ms < 1 then ms = 1 end
    return o, struct.pack(f, pre, unpack(new, 1, 4 * k + 1)), ms + ttl_slack_ms, stored_px
  end
  if z then
    -- Counted (a tier key's value).
    local f = pack_formats[-k]
    if not f then f = '<' .. string.rep('d', 4 * k) .. 'B'; pack_formats[-k] = f end
    new[4 * k + 1] = k
    return o, struct.pack(f, unpack(new, 1, 4 * k + 1)), px_of(latest - now), stored_px
  end
  local f = pack_formats[k]
  if not f then f = '<' .. string.rep('d', 4 * k); pack_formats[k] = f end
  return o, struct.pack(f, unpack(new, 1, 4 * k)), px_of(latest - now), stored_px
end

-- A pack of candidates whose tier key holds it (its KEYS entry is its live
-- check's: src/backend/redis/wire/args.rs, `pack_key`) in its value v:
-- the live value, a '\0', 32 bytes a state, and one byte, their number
-- (docs/redis.md, "Stored values"; no key and no write of its own). Found
-- from the end, by that number (no search and no copy): z, the '\0''s
-- position, 0 when v holds no pack.
-- Returns the new o and the record inline_write reads: { live check's
-- number, the pack charged (nil: none allows) and its PX, v, the stored
-- pack's PX (nil: no state of it lives), z (0: none), then [7], [8] the live value
-- to write and its PX, set by the caller when the request charges the
-- live check }.
local function pack_at(v)
  if not v then return 0 end
  local n = #v
  local count = string.byte(v, n)
  if not count then return 0 end
  local z = n - 32 * count - 1
  if z < 1 or string.byte(v, z) ~= 0 then return 0 end
  return z
end

local function candidate_inline(t, v, now, out, o)
  local z = pack_at(v)
  local value, px, stored_px
  o, value, px, stored_px = candidate_pack(t, v, now, out, o, z)
  return o, { t[15], value, px, v, stored_px, z }
end

-- The one write of a tier key that holds its candidates' pack (record r of
-- candidate_inline), when the request charged its live check (r[7], PX
-- r[8]) or committed the pack (`commit`): the live value charged or else
-- the stored one, a '\0', and the pack charged or else the stored one while
-- a state of it lives (without one, the live value alone, as a tier
-- without candidates writes it). The key lives as long as its
-- longer-lived part: the stored live value's own expiry is read (PTTL)
-- when only the pack was charged.
local function inline_write(key, r, commit)
  local live, live_px = r[7], r[8]
  local pack, pack_px = r[2], r[3]
  if not commit then pack = nil end
  if not live and not pack then return end
  local v, z = r[4], r[6]
  if not pack and r[5] then pack, pack_px = string.sub(v, z + 1), r[5] end
  if not live and v then
    if z == 0 then
      live = v
    elseif z > 1 then
      live = string.sub(v, 1, z - 1)
    end
    if live then live_px = rcall('PTTL', key) end
  end
  local px = live_px or 0
  if pack then
    if pack_px > px then px = pack_px end
    rcall('SET', key, (live or '') .. '\0' .. pack, 'PX', px)
  else
    rcall('SET', key, live, 'PX', px)
  end
end


-- The check of a request whose tiers are all plain (see tier_spec:
-- enforced, listed once, and of a kind written out here, so neither an
-- override nor a penalty box is among them): each algorithm's commonest
-- case inline, with no algorithm call and no table of pending writes; the
-- same reply, writes and rejected tiers as the general loop (no plain tier
-- has a delay or an undo value to trail: a window's undo is 0, a short
-- bucket's is derived by the client). A value not in the integer form
-- goes to the algorithm's own reader. nil (before anything is written) as
-- soon as a tier is not plain: the general loop then decides.
-- token_bucket.lua, leaky_bucket.lua, fixed_window.lua, calendar.lua and
-- sliding_window_counter.lua hold the general cases: keep them in step.
local function check_plain(now, first, n, states)
  if n == 0 then return nil end
  local spec = ARGV[first]
  local t = specs[spec]
  if t == nil then t = tier_spec(spec) end
  -- (A candidate comes after its live tier: never first but in a test.)
  if not t or not t[10] or t[15] then return nil end
  -- The reply presized as check_request's (it ends at its first nil); the
  -- first tier's write in locals, the others' in a table made for them.
  local out
  if n == 1 then
    -- (A tier carrying its candidates' pack answers them too: up to four.)
    if t[20] then out = { now, 0, 0, 0, 0, 0, 0, 0 } else out = { now, 0, 0, 0 } end
  elseif n <= 4 then
    out = { now, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }
  else
    out = { now }
  end
  local o = 1
  local value1, px1, writes
  local rejected, cands, inl
  -- Live tiers carrying their candidates' pack: the first in locals.
  local emb_i, emb_pack, emb
  for i = 1, n do
    local value, px
    if i > 1 then
      spec = ARGV[first + i - 1]
      t = specs[spec]
      if t == nil then t = tier_spec(spec) end
      if not t or not t[10] then return nil end
    end
    local kind = t[10]
    local v = states[i]
    -- A live tier carrying its candidates' pack: decided after the tiers.
    if t[20] then
      if not emb_i then
        emb_i, emb_pack = i, t[20]
      elseif emb then
        emb[#emb + 1], emb[#emb + 2] = i, t[20]
      else
        emb = { i, t[20] }
      end
    end
    if t[15] and kind ~= 8 then
      -- A candidate of the live tier numbered t[15].
      if cands then cands[i] = t[15] else cands = { [i] = t[15] } end
    end
    if kind == 8 then
      -- The candidates of one tier key, packed (candidate_pack): in the
      -- tier key's own value (candidate_inline; written with the live
      -- value below, by their rule) or in a key of their own (written by
      -- the candidates' rule below).
      if KEYS[i] == KEYS[t[15]] then
        local r
        o, r = candidate_inline(t, v, now, out, o)
        if inl then inl[#inl + 1] = r else inl = { r } end
      else
        if cands then cands[i] = t[15] else cands = { [i] = t[15] } end
        o, value, px = candidate_pack(t, v, now, out, o)
      end
    elseif kind == 1 or kind == 5 then
      -- A bucket of rate 1: the µs it is short of full (the token bucket)
      -- or its backlog (the leaky bucket) is TAT - now.
      local capacity = t[2]
      local cost = t[6] * t[4]
      local missing = 0
      if v then
        local tat = tonumber(v)
        if tat and tat < 1e18 then
          if tat > now then
            missing = tat - now
            -- (bucket_missing's bound; a leaky bucket's backlog of its own
            -- rate has none, as in leaky_backlog)
            if kind == 1 and missing > 4503599627370496 then missing = 4503599627370496 end
          end
        else
          -- Another form (another quota's, carried over): the general loop.
          return nil
        end
      end
      local ok, after
      if kind == 1 then
        local tokens = capacity - missing
        if tokens < 0 then tokens = 0 end
        ok = cost <= tokens
        after = capacity - tokens + cost
      else
        after = missing + cost
        ok = cost <= capacity and after <= capacity
      end
      if ok then
        out[o + 1] = missing
        value = format('%d', now + after)
        -- px_of(after), written out (the layer's default tier).
        local a = after + 999
        px = floor(a / 1000)
        if px * 1000 > a then px = px - 1 end
        if px < 1 then px = 1 end
        px = px + ttl_slack_ms
      else
        out[o + 1] = -missing - 1
        if t[15] then elseif rejected then rejected[#rejected + 1] = i else rejected = { i } end
      end
      o = o + 1
    elseif kind == 6 or kind == 7 then
      -- The sliding log. Of cost 1 listed once (kind 6), with the marker
      -- (every entry costs 1: sliding_window_log.lua): the entries' count
      -- is their cost, the marker's reverse rank less the entries out of
      -- the window (removed here: they count for nothing); a key found
      -- empty gets the marker with its entry. Its write: value the live
      -- count (-1: the key was empty), px the PX negated (log_write).
      -- Otherwise (a set without the marker, a key of another type, any
      -- other cost, a key listed again) its own function, which reads the
      -- members, its write a function (px false).
      local key, limit, window = KEYS[i], t[2], t[3]
      local r, used = false, nil
      if kind == 6 then
        r = redis.pcall('ZREVRANK', key, log_marker)
        if type(r) == 'number' then
          used = r - rcall('ZREMRANGEBYSCORE', key, '(-inf', format('%d', now - window))
        elseif r == false and rcall('ZCARD', key) == 0 then
          used = -1
        end
      end
      local allowed, remaining, reset, retry, _, write
      if used then
        local after = used + 1
        if used < 0 then after = 1 end
        if after <= limit then
          allowed, remaining, reset = 1, limit - after, window
          value, px = used, -(t[13] + ttl_slack_ms)
        else
          allowed, remaining, reset, retry =
            log_denied(key, now, limit, window, 1, format('%d', now - window), false)
        end
      else
        allowed, remaining, reset, retry, _, write =
          sliding_window_log(key, now, limit, window, 0, 0, t[6], nil, nil, kind == 6)
        value, px = write, false
      end
      if allowed ~= 1 then
        out[o + 1], out[o + 2], out[o + 3] = -remaining - 1, reset, retry
        if t[15] then elseif rejected then rejected[#rejected + 1] = i else rejected = { i } end
        o = o + 3
      elseif t[9] then
        -- Short: its remaining alone (its reset is the window, its wait 0).
        out[o + 1] = remaining
        o = o + 1
      else
        out[o + 1], out[o + 2], out[o + 3] = remaining, reset, 0
        o = o + 3
      end
    elseif kind == 4 then
      -- The sliding window counter (sliding_window_counter.lua).
      local limit, window, b = t[2], t[3], t[12]
      local cost = t[6]
      local start = floor(now / window)
      if start * window > now then start = start - 1 end
      start = start * window
      local prev, cur = 0, 0
      local x = v and tonumber(v)
      if v and not x then
        -- Another form: the long one, or another window length's (carried
        -- over: the general loop).
        local s, c, p, w = counter_read(v, window)
        if w ~= window then return nil end
        if s == start then
          prev, cur = p, c
        elseif s + window == start then
          prev = c
        end
      elseif v then
        local s = floor(x / window)
        if s * window > x then s = s - 1 end
        s = s * window
        local packed = x - s
        local p = floor(packed / b)
        if p * b > packed then p = p - 1 end
        local c = packed - p * b
        if s == start then
          prev, cur = p, c
        elseif s + window == start then
          prev = c
        end
      end
      local cap = limit * window
      local est = prev * (window - (now - start)) + cur * window
      if est + cost * window <= cap then
        local reset = start + 2 * window - now
        if cur + cost == 0 then reset = counter_reset(start, window, prev, 0, now) end
        local left = cap - est - cost * window
        local r = floor(left / window)
        if r * window > left then r = r - 1 end
        out[o + 1], out[o + 2], out[o + 3] = r, reset, 0
        if limit < b and prev < b then
          value = format('%d', start + prev * b + cur + cost)
        else
          value = format('%d:%d:%d', start, cur + cost, prev)
        end
        px = px_of(reset)
      else
        local _, remaining, reset, retry = sliding_window_counter(KEYS[i], now, limit, window,
          0, 0, cost, v, false)
        out[o + 1], out[o + 2], out[o + 3] = -remaining - 1, reset, retry
        if t[15] then elseif rejected then rejected[#rejected + 1] = i else rejected = { i } end
      end
      o = o + 3
    else
      -- A fixed window (kind 2) or a calendar window (kind 3):
      -- window_decide (fixed_window.lua) written out.
      local limit, start, window, margin = t[2], nil, nil, 0
      if kind == 2 then
        window = t[3]
        start = floor(now / window)
        if start * window > now then start = start - 1 end
        start = start * window
      else
        start, window = calendar_window(now, t[3], t[4], t[5])
        margin = 60000000
      end
      local cost = t[6]
      local count = 0
      if v then
        local x = tonumber(v)
        if x then
          if x >= start and x < start + window then count = x - start end
        else
          local s, e
          count, s, e = window_count(v, now, start, start + window)
          -- Another window's count (another quota's, carried over): the
          -- general loop.
          if count > 0 and (s ~= start or e ~= start + window) then return nil end
        end
      end
      local end_in = start + window - now
      local after = count + cost
      local allowed = after <= limit
      if t[9] then
        -- Short: the count before this request (window_decide).
        if allowed then out[o + 1] = count else out[o + 1] = -count - 1 end
        o = o + 1
      elseif allowed then
        local next_in = 0
        if after + cost > limit and cost <= limit then next_in = end_in end
        out[o + 1], out[o + 2], out[o + 3] = limit - after, end_in, next_in
        o = o + 3
      else
        local reset = end_in
        if count == 0 then reset = 0 end
        local remaining = limit - count
        if remaining < 0 then remaining = 0 end
        local retry = end_in
        if cost > limit then retry = reset end
        out[o + 1], out[o + 2], out[o + 3] = -remaining - 1, reset, retry
        o = o + 3
      end
      if allowed then
        if limit < window then
          value = format('%d', start + after)
        else
          value = format('%d:%d', start, after)
        end
        px = px_of(end_in + margin)
      elseif t[15] then
        -- A candidate's denial rejects nothing (below).
      elseif rejected then
        rejected[#rejected + 1] = i
      else
        rejected = { i }
      end
    end
    if i == 1 then
      value1, px1 = value, px
    elseif value then
      -- Tier i's value and PX at 2i - 1 and 2i (one table for both).
      if not writes then writes = {} end
      writes[2 * i - 1], writes[2 * i] = value, px
    end
  end
  -- Live tiers carrying their candidates' pack (tier_spec): the
  -- candidates' replies after every tier's, and one write of each tier
  -- key, of the live value (charged when no tier rejected) and the pack
  -- (charged when no tier but its own live one did: the candidates' rule
  -- below).
  if emb_i then
    local one = rejected and #rejected == 1 and rejected[1]
    local i, pack, q = emb_i, emb_pack, -1
    while i do
      local live, live_px
      if not rejected then
        if i == 1 then
          live, live_px, value1 = value1, px1, nil
        elseif writes then
          live, live_px = writes[2 * i - 1], writes[2 * i]
          writes[2 * i - 1] = nil
        end
      end
      -- Decided, and with their commit written with the live value in
      -- one SET, as inline_write writes them (no record table, and the
      -- new value made by one struct.pack): the live value charged, else
      -- the stored one (its PTTL), a '\0', and the pack charged, else the
      -- stored pack while a state of it lives.
      local key, v = KEYS[i], states[i]
      -- pack_at(v), written out.
      local z = 0
      if v then
        local nv = #v
        local count = string.byte(v, nv)
        if count then
          z = nv - 32 * count - 1
          if z < 1 or string.byte(v, z) ~= 0 then z = 0 end
        end
      end
      if rejected and one ~= i then
        -- (The request charged nothing of this key.)
        o = candidate_pack(pack, v, now, out, o, z, false)
      else
        local pre = live
        if not live and v then
          if z == 0 then pre = v elseif z > 1 then pre = string.sub(v, 1, z - 1) end
        end
        local value, px, stored_px
        o, value, px, stored_px = candidate_pack(pack, v, now, out, o, z, pre or '')
        if value then
          if not live and pre then live_px = rcall('PTTL', key) end
          if live_px and live_px > px then px = live_px end
          rcall('SET', key, value, 'PX', px)
        elseif live then
          if stored_px then
            if stored_px > live_px then live_px = stored_px end
            rcall('SET', key, live .. '\0' .. string.sub(v, z + 1), 'PX', live_px)
          else
            rcall('SET', key, live, 'PX', live_px)
          end
        end
      end
      q = q + 2
      if not emb then break end
      i, pack = emb[q], emb[q + 1]
    end
  end
  out[o + 1] = nil
  -- Tier keys holding their candidates' pack: one write each, of the live
  -- value (charged when no tier rejected) and the pack (charged by the
  -- candidates' rule below).
  if inl then
    for _, r in ipairs(inl) do
      local live = r[1]
      if not rejected then
        if live == 1 then
          r[7], r[8], value1 = value1, px1, nil
        else
          if writes then
            r[7], r[8] = writes[2 * live - 1], writes[2 * live]
            writes[2 * live - 1] = nil
          end
        end
      end
      inline_write(KEYS[live], r, not rejected or (#rejected == 1 and rejected[1] == live))
    end
  end
  -- Candidates (flag +16, never the first tier): each charged when it
  -- allowed and every live tier but its own did (check_request's rule;
  -- every plain tier is enforced).
  if cands then
    local one = rejected and #rejected == 1 and rejected[1]
    for i = 2, n do
      local live = cands[i]
      if live and writes and writes[2 * i - 1] ~= nil and (not rejected or one == live) then
        local value, px = writes[2 * i - 1], writes[2 * i]
        if not px then
          value()
        elseif px > 0 then
          rcall('SET', KEYS[i], value, 'PX', px)
        else
          log_write(KEYS[i], now, value, -px)
        end
      end
      if live and writes then writes[2 * i - 1] = nil end
    end
  end
  if not rejected then
    -- px: a SET's PX; negative, a sliding log's (log_write); false, a
    -- function that writes. (No value: written with its candidates.)
    if value1 == nil then
    elseif not px1 then
      value1()
    elseif px1 > 0 then
      rcall('SET', KEYS[1], value1, 'PX', px1)
    else
      -- log_write(KEYS[1], now, value1, -px1), written out (the layer's
      -- default log tier).
      local at = format('%d', now)
      if value1 < 0 then
        rcall('ZADD', KEYS[1], at, at, '-inf', log_marker)
      elseif rcall('ZADD', KEYS[1], at, at) == 0 then
        log_add(KEYS[1], now, value1 + 1, 1)
      end
      rcall('PEXPIRE', KEYS[1], -px1)
    end
    for i = 2, n do
      local value, px = writes and writes[2 * i - 1], writes and writes[2 * i]
      if value == nil then
        -- A candidate (written above).
      elseif not px then
        value()
      elseif px > 0 then
        rcall('SET', KEYS[i], value, 'PX', px)
      else
        log_write(KEYS[i], now, value, -px)
      end
    end
  end
  return out, rejected
end

-- One request's check of tiers 1..n, the body of both entry points (a
-- single Redis: check.lua; one hash slot of a cluster: cluster.lua's
-- 'check'; several requests of one call: batch.lua): clock is the clock
-- argument (see read_clock), or the call's now in µs (batch.lua, which
-- checks each request's deadline itself); tier i is KEYS[i]
-- with the spec ARGV[first + i - 1] (see tier_spec).
-- Decides every tier first; charges only if every enforced tier allows the
-- request, and then every tier that allows it (a shadow tier that would deny
-- is not charged, just as an enforced denial charges nothing).
--
-- Each algorithm returns allowed (0/1), remaining, reset_after_us,
-- retry_after_us, delay_us and, when it allows, its write (with the short
-- flag a token or leaky bucket, a fixed or calendar window returns its
-- state at `now` as remaining, units short of full, backlog ticks or the
-- window's count before the request, and 0 for the next three and the
-- undo value: the client derives them from the state, exactly as the long
-- form computes them): a value to SET
-- with PX the next result (ms) and the undo value after it, or a function
-- that writes and returns the undo value (the sliding window log and
-- concurrency, which add to a sorted set; the penalty box and an override's
-- read, whose function writes nothing).
-- retry_after_us of an ALLOWED tier is the wait, once it is charged, before
-- another request of the same cost would pass (0: at once, or not computed:
-- the sliding window algorithms return 0). The client reads it only when
-- the request was charged, to prime its deny cache; the decision it reports
-- has retry_after_us = 0.
--
-- Returns the check reply, whose layout is documented once, in
-- src/backend/redis/wire/mod.rs:
--   { now_us, per tier: s (short: a bucket's state) or r, reset_after_us,
--     w (three), then a trailer, three per entry: i, delay_us, undo }
--   or { now_us } when the clock's deadline has passed (nothing written);
-- and the numbers of the tiers that rejected (nil when none did). For a
-- malformed spec or an unknown algorithm: nil and the error message.
local function check_request(clock, first, n)
  -- (A number: the time batch.lua read once for its call.)
  local now, deadline
  if type(clock) == 'number' then now = clock else now, deadline = read_clock(clock) end
  if deadline and now > deadline then
    return { now }
  end
  -- No MGET when every tier is a sliding log (a sorted set, which reads
  -- its own state: the MGET would only answer nil for it).
  local states
  for i = 1, n do
    local t = specs[ARGV[first + i - 1]]
    if not t or t[1] ~= sliding_window_log then
      -- read_states(n), written out (a call less on every check).
      states = rcall('MGET', unpack(KEYS, 1, n))
      break
    end
  end
  if not states then states = {} end
  local plain, plain_rejected = check_plain(now, first, n, states)
  if plain then return plain, plain_rejected end
  -- The reply, and per allowing tier i, from pend[5i - 4]: its write, PX,
  -- undo, delay and undo flag (one table: a table per field costs more).
  -- Up to four tiers both are built at their full size at once: growing a
  -- table one slot at a time costs more than the check of a tier.
  -- (One tier, the commonest, gets tables of its own size.)
  local out, pend
  if n == 1 then
    out = { now, 0, 0, 0 }
    pend = { false, 0, 0, 0, false }
  elseif n <= 4 then
    out = { now, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }
    pend = { false, 0, 0, 0, false, false, 0, 0, 0, false,
      false, 0, 0, 0, false, false, 0, 0, 0, false }
  else
    out, pend = { now }, {}
  end
  local o = 1
  local rejected, carried
  local all = true
  -- Candidates (flag +16): their tiers' live checks by position, and the
  -- enforced denials (how many, and the last one's position).
  local cands, denials, denied_at = nil, 0, 0
  -- Packs of candidates (candidate_pack): how many checks of the client's
  -- each tier is past its own number; those a tier key holds
  -- (candidate_inline), by their live check's number.
  local shift, shifts = 0, nil
  local inl, emb
  for i = 1, n do
    -- The kept spec looked up here (a call less per tier), else parsed.
    local spec = ARGV[first + i - 1]
    local t = specs[spec]
    if t == nil then t = tier_spec(spec) end
    if not t then
      return nil, 'bad tier spec ' .. tostring(ARGV[first + i - 1])
    end
    -- The checks after a pack of k candidates are k - 1 further in the
    -- client's numbering (the trailer's i).
    if shift > 0 then
      if not shifts then shifts = {} end
      shifts[i] = shift
    end
    if t[10] == 8 then
      -- The candidates of one tier key, packed (candidate_pack): their
      -- replies, and the pack's write under their commit rule (below).
      local value, px
      if KEYS[i] == KEYS[t[15]] then
        -- In the tier key's value: written with the live value (below).
        local r
        o, r = candidate_inline(t, states[i], now, out, o)
        r[9] = i
        if not inl then inl = {} end
        inl[t[15]] = r
      else
        o, value, px = candidate_pack(t, states[i], now, out, o)
      end
      shift = shift + #t[16] - 1
      local p = 5 * i
      pend[p - 4], pend[p - 3], pend[p - 2], pend[p - 1], pend[p] = value or false, px, 0, 0, false
      if not cands then cands = {} end
      cands[i] = t[15]
    else
      -- A live tier carrying its candidates' pack (tier_spec): decided
      -- after the tiers.
      if t[20] then
        if emb then emb[#emb + 1], emb[#emb + 2] = i, t[20] else emb = { i, t[20] } end
      end
      -- A per-key override read by the check just before (override.lua).
      if override_next then t = override_apply(t) end
      local allowed, remaining, reset, retry, delay, write, ttl, undo, cv, cpx =
        t[1](KEYS[i], now, t[2], t[3], t[4], t[5], t[6], states[i], t[9], t[14])
      -- A state carried over a quota change (a key's first listing): stored
      -- below whatever the commit, unless its charge stores it.
      if cv and not t[11] then
        if carried then
          carried[#carried + 1], carried[#carried + 2], carried[#carried + 3] = i, cv, cpx
        else
          carried = { i, cv, cpx }
        end
      end
      penalty_tier_allowed = allowed == 1 -- for a penalty box right after (penalty.lua)
      if allowed == 1 then
        out[o + 1] = remaining
        if t[11] and write then write = charge_again(t, KEYS[i], now) end
        local p = 5 * i
        pend[p - 4], pend[p - 3], pend[p - 2], pend[p - 1], pend[p] = write, ttl, undo, delay, t[8]
      else
        out[o + 1] = -remaining - 1
        pend[5 * i - 4] = false
        if t[15] then
          -- A candidate's denial is its own: never a rejection of the request.
        else
          if rejected then rejected[#rejected + 1] = i else rejected = { i } end
          if not t[7] then all, denials, denied_at = false, denials + 1, i end
        end
      end
      if t[15] then
        if not cands then cands = {} end
        cands[i] = t[15]
      end
      -- Short (a bucket's state): one number; an override applied above
      -- builds a spec without the flag, so the tier answers three. A log
      -- answers short only when it allows (its remaining).
      if t[9] and (allowed == 1 or t[1] ~= sliding_window_log) then
        o = o + 1
      else
        out[o + 2] = reset
        out[o + 3] = retry
        o = o + 3
      end
    end
  end
  -- Live tiers carrying their candidates' pack: the candidates' replies
  -- after every tier's, and their record for the tier key's one write
  -- (inline_write below), with their commit (the candidates' rule below).
  if emb then
    for q = 1, #emb, 2 do
      local i = emb[q]
      local r
      o, r = candidate_inline(emb[q + 1], states[i], now, out, o)
      r[1], r[10] = i, denials == 0 or (denials == 1 and denied_at == i)
      if not inl then inl = {} end
      inl[i] = r
    end
  end
  -- Charge, then the trailer: every allowing tier with a delay, or with a
  -- non-zero undo value that it asked for (flag +2) when the request was
  -- charged.
  -- A candidate is charged when it allows and every enforced check but its
  -- tier's live one does (the request, with the candidate as its tier's
  -- quota, would have been admitted): its own commit rule.
  local commits
  if cands then
    commits = {}
    for i, live in pairs(cands) do
      commits[i] = denials == 0 or (denials == 1 and denied_at == live)
    end
  end
  for i = 1, n do
    local p = 5 * i
    local write = pend[p - 4]
    if write then
      local undo = 0
      local commit = all
      if commits and commits[i] ~= nil then commit = commits[i] end
      if commit then
        local r = inl and inl[i]
        if type(write) == 'function' then
          undo = write() or 0
        elseif r then
          -- A tier key holding its candidates' pack (inline_write below).
          r[7], r[8] = write, pend[p - 3]
          undo = pend[p - 2] or 0
        else
          rcall('SET', KEYS[i], write, 'PX', pend[p - 3])
          undo = pend[p - 2] or 0
        end
      end
      if not pend[p] then undo = 0 end
      local delay = pend[p - 1]
      if delay > 0 or undo ~= 0 then
        out[o + 1], out[o + 2], out[o + 3] = i + (shifts and shifts[i] or 0), delay, undo
        o = o + 3
      end
    end
  end
  if carried then
    for c = 1, #carried, 3 do
      local i = carried[c]
      local commit = all
      if commits and commits[i] ~= nil then commit = commits[i] end
      if not (commit and pend[5 * i - 4]) then
        local r = inl and inl[i]
        if r then
          r[7], r[8] = carried[c + 1], carried[c + 2]
        else
          rcall('SET', KEYS[i], carried[c + 1], 'PX', carried[c + 2])
        end
      end
    end
  end
  if inl then
    for live, r in pairs(inl) do
      local commit = r[10]
      if commit == nil then commit = commits[r[9]] end
      inline_write(KEYS[live], r, commit)
    end
  end
  -- The reply ends at its first nil (the slots presized for four tiers).
  out[o + 1] = nil
  return out, rejected
end
