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
-- is decided increment-first (incr_first below): its keys are INCRBY'd
-- before the decision, and a denial undoes them in the same call (DECRBY,
-- or DEL of a key it created), so no other command ever sees the charge;
-- but unlike check.lua, such a denial writes (both commands are
-- replicated and notified), where check.lua's writes nothing.
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
-- Returns   one reply per request, in order: check.lua's reply ({ now_us,
--           per tier ..., trailer }, or { now_us } when late), or an error
--           message in a table of its own, { "bad tier spec ..." } (a
--           malformed spec), for that request alone (an error reply nested
--           in the array would fail the whole call in the client).

-- Increment-first, for a request whose tiers are all enforced fixed
-- windows answering short, listed once, none a candidate, stored in the integer form
-- ("<window start µs + count>", limit < window: fixed_window.lua): INCRBY
-- each key by its cost first (its reply is the value already charged, so
-- no read), decide on the value before it, then on a window's first
-- request SET the window's own value, and for a denied request undo every
-- INCRBY (DECRBY; DEL for a key it created), so the request is still all
-- or nothing and leaves what it found. The reply and the rejected tiers
-- are check_plain's. nil, with nothing left written, for any other request
-- or a key that does not hold an integer (another form, another type):
-- check_request decides it then.
local function incr_first(keys, first, n, now)
  local specs_of = {}
  for i = 1, n do
    local t = specs[ARGV[first + i - 1]]
    if t == nil then t = tier_spec(ARGV[first + i - 1]) end
    -- A candidate (t[15]) has its own commit rule: check_request's.
    if not t or t[10] ~= 2 or not t[9] or t[15] or t[2] >= t[3] then return nil end
    specs_of[i] = t
  end
  local out, before, starts = { now }, {}, {}
  local rejected
  for i = 1, n do
    local t = specs_of[i]
    local r = redis.pcall('INCRBY', keys[i], t[6])
    if type(r) ~= 'number' then
      for j = i - 1, 1, -1 do
        if before[j] == 0 then redis.call('DEL', keys[j])
        else redis.call('DECRBY', keys[j], specs_of[j][6]) end
      end
      return nil
    end
    local window = t[3]
    local start = math.floor(now / window)
    if start * window > now then start = start - 1 end
    start = start * window
    local b = r - t[6]
    before[i], starts[i] = b, start
    local count = 0
    if b >= start and b < start + window then count = b - start end
    if count + t[6] <= t[2] then
      out[i + 1] = count
    else
      out[i + 1] = -count - 1
      if rejected then rejected[#rejected + 1] = i else rejected = { i } end
    end
  end
  for i = 1, n do
    local t, b, start = specs_of[i], before[i], starts[i]
    if rejected then
      if b == 0 then redis.call('DEL', keys[i])
      else redis.call('DECRBY', keys[i], t[6]) end
    elseif not (b >= start and b < start + t[3]) then
      -- The window's first request (the key was absent or of an earlier
      -- window): its own value, until the window ends.
      redis.call('SET', keys[i], int(start + t[6]), 'PX', px_of(start + t[3] - now))
    end
  end
  return out, rejected
end

local call_keys, call_argv = KEYS, ARGV
local now = read_clock(call_argv[1])
local slack = ttl_slack_ms
local n_keys = #call_keys
local sets = tonumber(call_argv[2])
local blocked, shadowed
if sets > 0 then blocked = call_keys[n_keys - sets + 1] end
if sets > 1 then shadowed = call_keys[n_keys] end
local replies = {}
local touched = { false, false }
local a, k, r = 3, 0, 0
while call_argv[a] do
  local n = tonumber(call_argv[a])
  local deadline = tonumber(call_argv[a + 1])
  local keys = {}
  for i = 1, n do keys[i] = call_keys[k + i] end
  r = r + 1
  if deadline > 0 and now > deadline then
    replies[r] = { now }
  else
    KEYS = keys
    override_next = false
    ttl_slack_ms = slack
    local out, rejected = incr_first(keys, a + 2, n, now)
    if not out then out, rejected = check_request(now, a + 2, n) end
    if not out then
      replies[r] = { rejected }
    else
      replies[r] = out
      if blocked and rejected then
        for _, i in ipairs(rejected) do
          local t = tier_spec(call_argv[a + 1 + i])
          local s = t[7] and 2 or 1
          -- (A shadow tier comes with the second set; without it, nothing
          -- to count, as in check.lua.)
          if s == 1 or shadowed then
            redis.call('ZINCRBY', s == 2 and shadowed or blocked, t[6], keys[i])
            touched[s] = true
          end
        end
      end
    end
  end
  a, k = a + 2 + n, k + n
end
KEYS = call_keys
for s, set in ipairs({ blocked, shadowed }) do
  if touched[s] then
    local extra = redis.call('ZCARD', set) - 10000
    if extra > 0 then redis.call('ZREMRANGEBYRANK', set, 0, extra - 1) end
    redis.call('EXPIRE', set, 90000)
  end
end
return replies
