-- Group commit on a single Redis: the checks of several requests in one
-- call (src/backend/redis/batch.rs sends one when requests arrived while
-- another call was in flight on the connection). Joined last, after
-- dispatch.lua, like check.lua: as a script (EVALSHA of BATCH_LUA, which
-- starts by making KEYS and ARGV locals) or, on Redis >= 7, as the body of
-- the function trl_batch_<v> of the library tiered_ratelimit_<v> (FCALL).
-- Each request is decided exactly as check.lua decides it alone, in the
-- order the requests are listed (their arrival order), each on the state
-- the requests before it left: all or nothing on its own keys, its own
-- deadline, its own reply. Redis TIME is read once per call.
-- A request whose tiers are all enforced fixed windows in the integer form
-- is decided increment-first (check_incr, dispatch.lua), as check.lua
-- decides it: one INCRBY per key, undone in the call on a denial.
--
-- ARGV[1]   the call's clock: "" = Redis TIME, or a test clock "<now
--           µs>[:<ttl slack ms>]" (ManualClock; tests only)
-- ARGV[2]   how many of the last KEYS are the hour's sets: "0" none, "1"
--           the refused keys' (check.lua's KEYS[n+1]), "2" that and the
--           shadow-limited keys' (KEYS[n+2])
-- then per request: ARGV[a] its number of tiers n, ARGV[a+1] its deadline
--           in Redis's clock (µs; "0" = none: a request that starts after
--           it writes nothing and answers { now_us }, "late"), ARGV[a+2 ..
--           a+1+n] its specs, exactly as check.lua's ARGV[1 + i]
-- KEYS      each request's n keys in turn (as check.lua's KEYS[1..n]), then
--           the sets ARGV[2] counts
-- Returns   the call's now_us, then per request in order: a request
--           decided increment-first its n counts inline (check_incr: the
--           short reply's numbers, without a now or a table of its own),
--           any other its reply as a table of its own: check.lua's reply
--           ({ now_us, per tier ..., trailer }, or { now_us } when late),
--           or an error message, { "bad tier spec ..." } (a malformed
--           spec), for that request alone (an error reply nested in the
--           array would fail the whole call in the client). The client
--           knows each request's n, so the two cannot be confused.

local call_keys, call_argv = KEYS, ARGV
-- Each request's number of tiers by its string (tonumber, a strtod, once
-- per distinct count: kept with the library, as the specs are).
local tier_counts = batch_tier_counts
local now = read_clock(call_argv[1])
local slack = ttl_slack_ms
local n_keys = #call_keys
local sets = tonumber(call_argv[2])
local blocked, shadowed
if sets > 0 then blocked = call_keys[n_keys - sets + 1] end
if sets > 1 then shadowed = call_keys[n_keys] end
local replies = { now }
-- The sets a denial added to (made at the first: most calls have none).
local touched
local a, k, o = 3, 0, 1
while call_argv[a] do
  local n = tier_counts[call_argv[a]]
  if not n then
    n = tonumber(call_argv[a])
    tier_counts[call_argv[a]] = n
  end
  local deadline = call_argv[a + 1]
  if deadline ~= '0' and now > tonumber(deadline) then
    o = o + 1
    replies[o] = { now }
  else
    local done, rejected = check_incr(call_keys, k, call_argv, a + 2, n, now, replies, o)
    if done then
      o = done
    else
      local keys = {}
      for i = 1, n do keys[i] = call_keys[k + i] end
      KEYS = keys
      override_next = false
      ttl_slack_ms = slack
      local out
      out, rejected = check_request(now, a + 2, n)
      o = o + 1
      if out then
        replies[o] = out
      else
        replies[o] = { rejected }
        rejected = nil
      end
    end
    if blocked and rejected then
      for _, i in ipairs(rejected) do
        local t = tier_spec(call_argv[a + 1 + i])
        local s = t[7] and 2 or 1
        -- (A shadow tier comes with the second set; without it, nothing
        -- to count, as in check.lua.)
        if s == 1 or shadowed then
          rcall('ZINCRBY', s == 2 and shadowed or blocked, t[6], call_keys[k + i])
          if not touched then touched = { false, false } end
          touched[s] = true
        end
      end
    end
  end
  a, k = a + 2 + n, k + n
end
KEYS = call_keys
if touched then
  trim_key_sets(blocked, shadowed, touched)
end
return replies
