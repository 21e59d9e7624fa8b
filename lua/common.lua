-- Shared helpers for the algorithm scripts. The files of lua/ are joined in
-- this order into ONE script (see src/backend/redis/wire/mod.rs):
--   common.lua, fixed_window.lua, sliding_window_log.lua,
--   sliding_window_counter.lua, token_bucket.lua, leaky_bucket.lua,
--   concurrency.lua, penalty.lua, dispatch.lua, check.lua
-- (the cluster script puts refund.lua before
-- dispatch.lua and ends with cluster.lua instead of check.lua).
--
-- Lua numbers are doubles: every value these scripts handle is an integer
-- below 2^53 (the limits are checked when a quota is built), so all
-- arithmetic is exact once division is corrected to integer division.
-- ARGV values are strings: always tonumber() them.

-- floor(a / b) for integers a, b > 0 below 2^53. The double quotient a / b
-- is correctly rounded and rounding is monotonic, so floor() of it is never
-- below the true floor and at most one above it (when the true quotient is
-- just below an integer that it rounds to): one correction suffices.
local function div_floor(a, b)
  local q = math.floor(a / b)
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
  return string.format('%d', x)
end

-- Whether `flags` (a tier's flags, see dispatch.lua) has `bit` set.
local function has_flag(flags, bit)
  return flags % (bit + bit) >= bit
end

-- Stored values come in two formats (docs/redis.md, "Stored values"):
-- "legacy", the colon-separated strings of every release before the compact
-- format, and "compact", integers wherever the quota allows. Every script
-- reads both; a tier's flag +4 says which one its writes use (a fleet keeps
-- writing legacy until no instance of an older release is left, since those
-- read a compact value as no state). A refund writes the format it read.
--
-- "<n><ddd>": an integer n followed by exactly three digits, the form of the
-- bucket TATs (n = the TAT in µs) and of the log's members (n = the time).
local function with_code(n, code)
  return string.format('%d%03d', n, code)
end

-- n and the three-digit code of a value "<n><ddd>" (no separator), or nil.
local function split_code(v)
  local n, code = string.match(v, '^(%d+)(%d%d%d)$')
  if not n then return nil end
  return tonumber(n), tonumber(code)
end

-- The integer square root, exact for n <= 2^53.
local function isqrt(n)
  local r = math.floor(math.sqrt(n))
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
-- replaces it. Values are written with string.format('%d'): Redis's Lua
-- formats %d as a C long (64 bits), exact for every integer below 2^53.
