-- One control-key poll's rollout work in one call (src/engine/rollout/
-- poll.rs): this instance's stage counts (stage.lua), its guard counts and
-- the guard's lease (guard.lua), the plan's steps (plan.lua: the leader's
-- renewal, tick or takeover, a pending fall back), then the read of the
-- control hash that the poll would otherwise make on its own. The three
-- scripts are this one's functions `stage_part`, `guard_part` and
-- `plan_part` (prepended by src/backend/redis/plan.rs), each given its own
-- KEYS and ARGV, so each keeps its guarantees: a plan step is still one
-- compare-and-set on the plan's version. Every key is in the control
-- hash's slot (its hash tag, or the whole control key as one).
--
-- KEYS[1]  the control hash
-- KEYS[2]  the rollout log
-- KEYS[3…] the parts' keys, in the parts' order
-- ARGV[1]  the clock: "" reads Redis TIME; "<µs>" is a test's manual clock
-- ARGV[2]  the number of parts, then each part: its kind, its tier, its
--          number of keys, its number of arguments, its arguments
--   stage  3 keys, stage.lua's ARGV: answers {checks, enforced, bits}
--   guard  3 keys, guard.lua's ARGV: answers {lead, fields}
--   plan   no key, plan.lua's ARGV from ARGV[2] on: answers {code, field}
--   gated  no key; 9 gate arguments, then plan.lua's ARGV from ARGV[2] on
--          (a tick): the floors judged on the stage's fleet-wide totals the
--          tier's stage part (earlier in this call) answered: min_requests,
--          min_bits (the map's bits that make min_keys keys), the enforced
--          cohort's most share in basis points (-1: none), their three
--          reasons, then whether the rest of the gates were asked (1/0),
--          their hold ("": pass) and their evidence. A floor that fails
--          holds with its reason; else the rest's hold; else, the rest not
--          asked, the step renews the lease only.
--
-- Answers {each part's answer…, the control hash's fields (HGETALL)}.

local out = {}
local stages = {}
local key_at = 3
local arg_at = 3

local function num(x) return string.format('%.0f', x) end

local parts = tonumber(ARGV[2])
for _ = 1, parts do
  local kind = ARGV[arg_at]
  local tier = ARGV[arg_at + 1]
  local nkeys = tonumber(ARGV[arg_at + 2])
  local nargs = tonumber(ARGV[arg_at + 3])
  local keys, args = {}, {}
  for k = 1, nkeys do keys[k] = KEYS[key_at + k - 1] end
  for a = 1, nargs do args[a] = ARGV[arg_at + 3 + a] end
  key_at = key_at + nkeys
  arg_at = arg_at + 4 + nargs
  if kind == 'stage' then
    local t = stage_part(keys, args)
    stages[tier] = t
    out[#out + 1] = t
  elseif kind == 'guard' then
    out[#out + 1] = guard_part(keys, args)
  else
    local plan = {ARGV[1]}
    local from = 1
    if kind == 'gated' then from = 10 end
    for a = from, nargs do plan[#plan + 1] = args[a] end
    if kind == 'gated' then
      local t = stages[tier] or {0, 0, 0}
      local requests, enforced, bits = t[1], t[2], t[3]
      local most = tonumber(args[3])
      local holding
      if requests < tonumber(args[1]) then
        holding = args[4]
      elseif bits < tonumber(args[2]) then
        holding = args[5]
      elseif most >= 0 and requests > 0 and math.floor(enforced * 10000 / requests) > most then
        holding = args[6]
      elseif args[7] == '1' then
        holding = args[8]
      else
        -- plan.lua's ARGV[5], the action: the rest of the gates not asked.
        plan[5] = 'renew'
        holding = ''
      end
      -- Linear counting, as the leader's own estimate (gates.rs).
      local keys_seen = math.floor(-65536 * math.log(math.max(65536 - bits, 1) / 65536) + 0.5)
      plan[7] = holding
      plan[9] = 'requests=' .. num(requests) .. ' keys=' .. num(keys_seen) ..
        ' enforced=' .. num(enforced) .. ' ' .. args[9]
    end
    out[#out + 1] = plan_part({KEYS[1], KEYS[2]}, plan)
  end
end
out[#out + 1] = redis.call('HGETALL', KEYS[1])
return out
