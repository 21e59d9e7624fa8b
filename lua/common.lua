-- Shared helpers for the algorithm scripts. The files of lua/ are joined
-- into ONE script (the lua! macro in src/backend/redis/wire/mod.rs), so a
-- file may use any local of a file joined before it. Every script starts
-- with
--   common.lua, fixed_window.lua, calendar.lua, sliding_window_log.lua,
--   sliding_window_counter.lua, token_bucket.lua, leaky_bucket.lua,
--   concurrency.lua, penalty.lua, override.lua
-- and ends, by script, with
--   the check (CHECK_LUA, EVALSHA)      dispatch.lua, check.lua
--   the check as a Redis Function       dispatch.lua, then check.lua as the
--     (Redis >= 7, FCALL; LIBRARY_BODY) body of check_main, between the
--                                       library's head and its
--                                       register_function line
--   group commit, several requests     dispatch.lua, batch.lua (BATCH_LUA
--     in one call (EVALSHA; as a        starts by making KEYS and ARGV
--     Function: trl_batch_<v>)          locals, which batch.lua sets)
--   the cluster script (CLUSTER_LUA;    refund.lua, dispatch.lua, cluster.lua
--     a single Redis runs its refunds)
--   a peek (PEEK_LUA)                   dispatch.lua, peek.lua
--   a slot renewal (SLOT_LUA)           dispatch.lua, slot.lua
--
-- Before common.lua every script (and the library) declares the globals
-- it reads as locals, and rcall, floor and format: redis.call, math.floor
-- and string.format (lua_globals! and lua_shorts! in
-- src/backend/redis/wire/mod.rs: an upvalue read is cheaper than a
-- global's, most of all in a Redis Function).
--
-- Lua numbers are doubles: every number these scripts compute with is an
-- integer below 2^53 (the limits are checked when a quota is built), so all
-- arithmetic is exact once division is corrected to integer division. The
-- one stored number above 2^53, a bucket's coded TAT of rate 2..44 (19
-- digits: tat_value below), is split as a string (tat_read), never computed
-- with as one number.
-- ARGV values are strings: always tonumber() them.

-- floor(a / b) for integers a, b > 0 below 2^53. The double quotient a / b
-- is correctly rounded and rounding is monotonic, so floor() of it is never
-- below the true floor and at most one above it (when the true quotient is
-- just below an integer that it rounds to): one correction suffices.
local function div_floor(a, b)
  local q = floor(a / b)
  if q * b > a then q = q - 1 end
  return q
end

local function div_ceil(a, b)
  return div_floor(a + b - 1, b)
end

-- Extra milliseconds added to every TTL. Always 0 in production; tests that
-- drive a manual clock faster or slower than Redis's own may set it (ARGV[1]
-- "<now_us>:<slack_ms>") so that real-time expiry never runs ahead of the
-- test's clock.
local ttl_slack_ms = 0

-- Time-to-live in whole milliseconds (rounded up, at least 1) for PX.
local function ttl_ms(us)
  local ms = div_ceil(us, 1000)
  if ms < 1 then ms = 1 end
  return ms + ttl_slack_ms
end

-- An integer as a string without exponent (tostring would print 1.7e+15).
-- Redis's Lua formats %d as a C long (64 bits): exact below 2^53, and half
-- the cost of '%.0f'.
local function int(x)
  return format('%d', x)
end

-- Whether `flags` (a tier's flags, see dispatch.lua) has `bit` set.
local function has_flag(flags, bit)
  return flags % (bit + bit) >= bit
end

-- A tier key's value may hold, after a '\0', the packed states of the
-- tier's candidate quotas (candidate_pack in dispatch.lua; docs/redis.md,
-- "Stored values"). Every reader reads the live value before it: an
-- integer form through tonumber, which in Lua 5.1 reads a string up to
-- its first '\0' (luaO_str2d); any other form when its pattern fails, by
-- reading again the part before the '\0' (this, nil for a value without
-- one), so a value without a pack costs nothing more.
local function live_part(v)
  local z = string.find(v, '\0', 1, true)
  if z then return string.sub(v, 1, z - 1) end
  return nil
end

-- Stored values have one format (docs/redis.md, "Stored values"): one
-- integer per key wherever the quota allows, which Redis keeps inside the
-- object (OBJECT ENCODING int), else a short string of the same meaning.
--
-- "<n><ddd>": an integer n followed by exactly three digits, the form of a
-- bucket's TAT of rate 2..44 (n = the TAT in µs, ddd its rate and
-- remainder: tat_value below) and of the log's members (n = the time).
local function with_code(n, code)
  return format('%d%03d', n, code)
end

-- n and the three-digit code of a value "<n><ddd>" (no separator), or nil.
local function split_code(v)
  local n, code = string.match(v, '^(%d+)(%d%d%d)$')
  if not n then return nil end
  return tonumber(n), tonumber(code)
end

-- A bucket's TAT, tat + frac / rate µs (0 <= frac < rate; the token bucket
-- and the leaky bucket both keep it), as ONE value. Under the tier's
-- configured quota (its home: the spec has no home suffix, see tier_spec
-- in dispatch.lua), whose unit the reader knows:
--   rate 1        "<tat>", an integer (the TAT in µs: GET reads as a time)
--   rate 2..44    "<tat><ddd>", an integer of 19 digits: ddd = (rate - 1) ×
--                 rate / 2 - 1 + frac (0..988), which names the rate and
--                 the remainder (rate 2: 000-001, rate 3: 002-004, ...,
--                 rate 44: 945-988); below 2^63 until the year 2262
--   rate above 44 "<tat>:<frac>:<rate>", a string (its three numbers
--                 cannot share the 19 digits of a 64-bit integer)
-- and under any other unit (a quota changed at run time, a plan's, an
-- override's) "<tat>:<frac>:<rate>:<unit>", which names its quota: a reader
-- under another quota carries its used capacity over (carry_units).
local function tat_value(tat, frac, rate, unit)
  if unit then return format('%d:%d:%d:%d', tat, frac, rate, unit) end
  if rate == 1 then return format('%d', tat) end
  if rate <= 44 then return format('%d%03d', tat, (rate - 1) * rate / 2 - 1 + frac) end
  return format('%d:%d:%d', tat, frac, rate)
end

-- floor(r × a / b) and whether there is a remainder, for integers
-- 0 <= r < b and 0 <= a below 2^53, exactly: the product may pass 2^53,
-- so it is built bit by bit of a, modulo b (every value stays below 2^53:
-- doubles are exact there). Only a quota change's carry uses it.
local function mul_div(r, a, b)
  local bits, n = {}, 0
  while a > 0 do
    local bit = a % 2
    n = n + 1
    bits[n] = bit
    a = (a - bit) / 2
  end
  local q, m = 0, 0 -- r × (a's bits so far) = q × b + m, 0 <= m < b
  for i = n, 1, -1 do
    q = q + q
    if m >= b - m then m = m - (b - m); q = q + 1 else m = m + m end
    if bits[i] == 1 then
      if m >= b - r then m = m - (b - r); q = q + 1 else m = m + r end
    end
  end
  return q, m > 0
end

-- A bucket's used capacity carried over a quota change (twin of
-- carry_units in src/algorithm/mod.rs): `units` of a quota of `from` units
-- per token in units of `to` per token, ceil(units × to / from), at most
-- 2^52.
local function carry_units(units, from, to)
  if from == to then return units end
  local most = 4503599627370496
  local whole = div_floor(units, from)
  if whole > 0 and whole > div_floor(most, to) then return most end
  local q, rest = mul_div(units - whole * from, to, from)
  local carried = whole * to + q
  if rest then carried = carried + 1 end
  if carried > most then carried = most end
  return carried
end

-- The (tat, frac, rate, unit) of a value of tat_value (unit nil for the
-- home forms), or nil for any other.
local function tat_read(v)
  local n = tonumber(v)
  if n then
    -- A TAT in µs has 16 digits (until 2286), a coded one 19.
    if n < 1e18 then return n, 0, 1 end
    local t, code = split_code(v)
    if not t then
      local l = live_part(v)
      if l then return tat_read(l) end
      return nil
    end
    -- The rate: the largest r with (r - 1) r / 2 - 1 <= code.
    local r = floor((1 + math.sqrt(8 * code + 9)) / 2)
    while (r - 1) * r / 2 - 1 > code do r = r - 1 end
    while r * (r + 1) / 2 - 1 <= code do r = r + 1 end
    if r > 44 then return nil end
    return t, code + 1 - (r - 1) * r / 2, r
  end
  local t, f, r, u = string.match(v, '^(%d+):(%d+):(%d+):?(%d*)$')
  if not t then
    local l = live_part(v)
    if l then return tat_read(l) end
    return nil
  end
  t, f, r = tonumber(t), tonumber(f), tonumber(r)
  if r < 1 or f >= r then return nil end
  if u == '' then return t, f, r end
  u = tonumber(u)
  if u < 1 then return nil end
  return t, f, r, u
end

-- The integer square root, exact for n <= 2^53.
local function isqrt(n)
  local r = floor(math.sqrt(n))
  while r * r > n do r = r - 1 end
  while (r + 1) * (r + 1) <= n do r = r + 1 end
  return r
end

-- Every tier's stored value is read up front with ONE MGET of all the
-- request's keys (see read_states in dispatch.lua) and handed to the
-- algorithm as its last argument `v` (false when absent). MGET answers nil
-- for a key of another type, so a key written by another algorithm (the
-- tier's algorithm changed, or two layers share a prefix) is read as no
-- state, never as a script error that would fail open; the commit's SET
-- replaces it. The numbers in a value are written with '%d' (see int above):
-- Redis's Lua formats %d as a C long (64 bits), exact below 2^53.
