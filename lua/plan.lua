-- A tier's staged rollout plan (src/engine/rollout/): one compare-and-set
-- on the plan's state, kept in the control hash beside the modes, so each
-- step happens exactly once however many instances try it. Called alone
-- (operators' actions, a guard's fall back) and as lua/poll.lua's
-- `plan_part` (the leader's step in its one call a poll).
--
-- KEYS[1]  the control hash
-- KEYS[2]  the rollout log, a capped stream in the control hash's slot
-- ARGV[1]  the clock: "" reads Redis TIME; "<µs>" is a test's manual clock
-- ARGV[2]  the tier
-- ARGV[3]  the calling instance's id (no spaces)
-- ARGV[4]  the plan version the caller read (0: no plan stored)
-- ARGV[5]  the action: start | pause | resume | abort | tick | renew |
--          fallback | guard (renew: the lease only, the gates not asked
--          yet; guard: the fall back guard's, under its own lease, on a
--          tier with or without a plan)
-- ARGV[6]  tick: the lease beat the caller saw unchanged for a lease's
--          lifetime ("" when the caller believes it holds the lease)
-- ARGV[7]  tick: the gate that holds ("" when every gate passes);
--          abort/fallback: the reason
-- ARGV[8]  who asked (leader, handle, admin, guard)
-- ARGV[9]  the evidence, as text, for the log
-- ARGV[10] the log's cap (XADD MAXLEN ~)
-- ARGV[11] the number of stages n, then n pairs: mode, duration in µs
--          (-1: the last stage, which has none)
--
-- The field `plan:<tier>` holds, separated by single spaces:
--   version stage status since_us next_at_us paused_at_us leader beat holding
-- (status: running | paused | done | aborted | fellback; next_at_us 0: no
-- next stage; holding: the rest of the line, empty when nothing holds).
-- Every change but a lease renewal increments the version; the leader's
-- renewal increments the beat only. Answers {code, the field as stored}:
-- 1 changed, 0 renewed or nothing to do, -1 the version moved (another
-- instance came first: read again), -2 another instance holds the lease,
-- -3 the action does not apply in this status, -4 the stored field is
-- malformed.

local field = 'plan:' .. ARGV[2]
local me = ARGV[3]
local read = tonumber(ARGV[4])
local op = ARGV[5]

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
end

local n = tonumber(ARGV[11])
local function stage_mode(i) return ARGV[12 + 2 * i] end
local function stage_for(i) return tonumber(ARGV[13 + 2 * i]) end

local raw = redis.call('HGET', KEYS[1], field)
local s
if raw then
  local v, st, status, since, nxt, paused, leader, beat, holding =
    string.match(raw, '^(%d+) (%d+) (%a+) (%d+) (%d+) (%d+) (%S+) (%d+) ?(.*)$')
  if not v then return {-4, raw} end
  s = { version = tonumber(v), stage = tonumber(st), status = status,
        since = tonumber(since), next_at = tonumber(nxt), paused = tonumber(paused),
        leader = leader, beat = tonumber(beat), holding = holding }
else
  s = { version = 0, stage = 0, status = 'idle', since = 0, next_at = 0, paused = 0,
        leader = '-', beat = 0, holding = '' }
end
if s.version ~= read then return {-1, raw or ''} end

local function num(x) return string.format('%.0f', x) end
local function log(event, reason)
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[10], '*',
    'at_us', num(now), 'tier', ARGV[2], 'event', event, 'stage', num(s.stage),
    'mode', stage_mode(s.stage) or '', 'version', num(s.version + 1),
    'instance', me, 'by', ARGV[8], 'reason', reason or '', 'evidence', ARGV[9])
end
local function enter(i)
  s.stage = i
  s.since = now
  s.holding = ''
  local d = stage_for(i)
  if d and d >= 0 then
    s.next_at = now + d
  else
    s.next_at = 0
    s.status = 'done'
  end
  redis.call('HSET', KEYS[1], 'tier:' .. ARGV[2], stage_mode(i))
end
local function store(code)
  s.beat = s.beat + 1
  local text = num(s.version) .. ' ' .. num(s.stage) .. ' ' .. s.status .. ' ' ..
    num(s.since) .. ' ' .. num(s.next_at) .. ' ' .. num(s.paused) .. ' ' ..
    s.leader .. ' ' .. num(s.beat) .. ' ' .. s.holding
  redis.call('HSET', KEYS[1], field, text)
  return {code, text}
end

if op == 'start' then
  if s.status == 'running' or s.status == 'paused' then return {-3, raw} end
  s.status = 'running'
  s.leader = me
  s.paused = 0
  log('start', '')
  enter(0)
  if s.status == 'done' then log('done', '') end
  s.version = s.version + 1
  return store(1)
elseif op == 'pause' then
  if s.status ~= 'running' then return {-3, raw or ''} end
  s.status = 'paused'
  s.paused = now
  log('pause', '')
  s.version = s.version + 1
  return store(1)
elseif op == 'resume' then
  if s.status ~= 'paused' then return {-3, raw or ''} end
  s.status = 'running'
  if s.next_at > 0 then s.next_at = s.next_at + (now - s.paused) end
  s.paused = 0
  s.leader = me
  log('resume', '')
  s.version = s.version + 1
  return store(1)
elseif op == 'abort' then
  if s.status ~= 'running' and s.status ~= 'paused' then return {-3, raw or ''} end
  s.status = 'aborted'
  s.next_at = 0
  s.holding = ''
  redis.call('HSET', KEYS[1], 'tier:' .. ARGV[2], stage_mode(0))
  log('abort', ARGV[7])
  s.version = s.version + 1
  return store(1)
elseif op == 'guard' then
  -- The tier to shadow fleet-wide and its plan (running or paused)
  -- stopped, once: nothing to do when the tier's fleet mode is shadow.
  local mode = 'tier:' .. ARGV[2]
  if redis.call('HGET', KEYS[1], mode) == 'shadow' then return {0, raw or ''} end
  redis.call('HSET', KEYS[1], mode, 'shadow')
  log('fallback', ARGV[7])
  if not raw then return {1, ''} end
  if s.status == 'running' or s.status == 'paused' then
    s.status = 'fellback'
    s.next_at = 0
    s.paused = 0
    s.holding = ''
  end
  s.version = s.version + 1
  return store(1)
end

-- tick, renew and fallback: the leader's work, under the lease.
if s.status ~= 'running' then return {0, raw or ''} end
local changed = false
if s.leader ~= me then
  if ARGV[6] == '' or tonumber(ARGV[6]) ~= s.beat then return {-2, raw} end
  s.leader = me
  log('takeover', 'the lease lapsed (beat ' .. num(s.beat) .. ' unchanged)')
  changed = true
end
if op == 'fallback' then
  s.status = 'fellback'
  s.next_at = 0
  s.holding = ''
  redis.call('HSET', KEYS[1], 'tier:' .. ARGV[2], 'shadow')
  log('fallback', ARGV[7])
  changed = true
elseif op == 'tick' and s.next_at > 0 and now >= s.next_at then
  if ARGV[7] == '' and s.stage + 1 >= n then
    -- The caller's plan has no next stage (it was shortened): done here.
    s.status = 'done'
    s.next_at = 0
    log('done', 'no stage ' .. num(s.stage + 1) .. ' in the plan')
    changed = true
  elseif ARGV[7] == '' then
    enter(s.stage + 1)
    log('advance', '')
    if s.status == 'done' then log('done', '') end
    changed = true
  elseif ARGV[7] ~= s.holding then
    s.holding = ARGV[7]
    log('hold', ARGV[7])
    changed = true
  end
end
if changed then
  s.version = s.version + 1
  return store(1)
end
return store(0)
