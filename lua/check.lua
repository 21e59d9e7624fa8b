-- The check of a single Redis: every tier of one request, all or nothing,
-- in one call. Joined last, after dispatch.lua (common.lua gives the order),
-- and run either as a script (EVALSHA of CHECK_LUA: Redis 6, or where
-- Functions are not used) or, on Redis >= 7, as the body of the function
-- trl_check_<v> of the library tiered_ratelimit_<v> (FCALL; KEYS and ARGV
-- are then the library's locals, set on every call). Either way it runs
-- check_request (dispatch.lua), which decides a request whose tiers are all
-- enforced rate-1 token buckets with the short reply in check_plain,
-- written out.
--
-- KEYS[i]   the key of tier i: "<prefix>:<tier>:<key part>" (a penalty box
--           "<tier key>{pb}", an override's read "<tier key>{ov}")
-- ARGV[1]   "" to read the clock with Redis TIME (production);
--           "-<deadline µs>": Redis TIME, and if it is past the deadline the
--           app has already given up on this check: write nothing, return
--           { now_us } ("late");
--           or a test clock in Unix epoch microseconds (ManualClock; tests
--           only), optionally followed by ":<ttl slack ms>" (see common.lua)
-- ARGV[1 + i] the spec of tier i, one argument: "<algorithm> <p1> <p2> <p3>
--           <p4> <cost> <flags>" (see tier_spec in dispatch.lua): algorithm
--           (1 fixed_window, 2 sliding_window_log, 3 sliding_window_counter,
--           4 token_bucket, 5 leaky_bucket, 6 concurrency, 7 penalty box,
--           8 a per-key override's read, which applies to the tier after it:
--           override.lua, 9 calendar window: calendar.lua; the table
--           `algorithms` in dispatch.lua), p1..p4 (the algorithm's parameters, see each
--           file), cost, flags: +1 shadow (the tier is in shadow mode: its
--           denial does not stop the other tiers from being charged), +2
--           undo (return the charge's undo value, for a refund by response
--           status), +4 repeat (the key was listed before in this call:
--           charge it on what that listing stored, dispatch.lua), +8 short
--           (a token or leaky bucket, a fixed or calendar window answers
--           its state, one number instead
--           of three), +16 candidate (a candidate quota of its tier, whose
--           live check is number floor(flags / 32) of this call: its
--           denial rejects nothing, and it is charged when it allows and
--           every enforced check but that one allows; docs/rollout.md,
--           "Candidate quotas"); or a pack of candidates, "10 <live> <k>
--           ..." on the key "<tier key>{c}" (pack_spec in dispatch.lua)
-- KEYS[n+1] optional, with KEYS[n+2] when a tier is sent the shadow flag
-- KEYS[n+2] (else it is left out): the hourly sorted sets of the
--           fleet-wide top-N: every enforced tier that rejects adds its
--           cost to its key's score in KEYS[n+1] (refused keys), every
--           shadow tier that would have rejected in KEYS[n+2]
--           (shadow-limited keys: the request was not refused for it);
--           each set keeps its 10 000 heaviest keys and lives 25 h.
-- Returns   the check reply of check_request (lua/dispatch.lua), whose layout
--           is documented in src/backend/redis/wire/mod.rs: { now_us, then
--           per tier its state (short) or r, reset_after_us, w, then a
--           trailer of i, delay_us, undo per tier that needs one }, or
--           { now_us } when late.
-- Stored values have one format (docs/redis.md, "Stored values"): a
-- bucket's TAT as tat_value writes it (common.lua), each other algorithm's
-- as its file says.
-- Writes happen only if every enforced tier allows the request; then every
-- tier that allows it is charged (a shadow tier that would deny is not, just
-- as an enforced denial charges nothing). The writes a denial makes: the
-- rejected-keys set above, a penalty box's strike or block when its
-- tier denied (penalty.lua), and for a request of enforced fixed windows
-- alone (increment-first: check_incr in dispatch.lua) an INCRBY per key
-- undone in the same call (DECRBY, or DEL of a key it created), which
-- leaves every value as it was but is replicated and notified.

local tiers = #ARGV - 1
-- A request of fixed windows alone: increment-first (check_incr,
-- dispatch.lua); any other, or a key in another form: check_request.
-- Its first spec's record tells (one table lookup), so a request of
-- another algorithm pays no table and no call for it.
local out, rejected
local rec = tiers > 0 and incr_recs[ARGV[2]]
if rec == nil then rec = incr_rec(ARGV[2]) end
if rec then
  local now, deadline = read_clock(ARGV[1])
  if deadline and now > deadline then return { now } end
  out = { now }
  local done
  done, rejected = check_incr(KEYS, 0, ARGV, 2, tiers, now, out, 1)
  if not done then out, rejected = check_request(now, 2, tiers) end
else
  out, rejected = check_request(ARGV[1], 2, tiers)
end
if not out then
  return redis.error_reply(rejected)
end

local blocked, shadowed = KEYS[tiers + 1], KEYS[tiers + 2]
if blocked and rejected then
  local touched = { false, false }
  for _, i in ipairs(rejected) do
    local t = tier_spec(ARGV[1 + i])
    local s = t[7] and 2 or 1
    local set = s == 2 and shadowed or blocked
    -- (A shadow tier comes with KEYS[n+2]; without it, nothing to count.)
    if s == 1 or shadowed then
      rcall('ZINCRBY', set, t[6], KEYS[i])
      touched[s] = true
    end
  end
  trim_key_sets(blocked, shadowed, touched)
end
return out
