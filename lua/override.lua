-- A per-key override (src/handle/overrides.rs; the rule a check applies:
-- src/backend/override_rule.rs), read as a check of its own right
-- BEFORE the tier it applies to, on the key "<tier key>{ov}" (same hash
-- slot): its value comes with the other keys' in the check's one MGET.
-- Value "<until µs> <kind> <p1> <p2> <p3> <p4> <capacity>": until 0 = no
-- expiry; kind 0 = another quota (p1..p4 the tier algorithm's parameters,
-- capacity its X-RateLimit-Limit), 1 = unlimited, 2 = blocked. It always allows and writes nothing; what it read
-- is applied by check_request (dispatch.lua) to the next tier's spec
-- (override_apply). Its remaining tells the client what applied: 0 none,
-- 1 unlimited, 2 blocked, 3 + the quota's capacity.

-- What the override check just read, for the next tier (false: none).
local override_next = false

local function override_commit() return 0 end

local function override(_, now, _, _, _, _, _, v, _)
  override_next = false
  if not v then return 1, 0, 0, 0, 0, override_commit end
  local u, k, p1, p2, p3, p4, cap =
    string.match(v, '^(%d+) ([012]) (%d+) (%d+) (%d+) (-?%d+) (%d+)$')
  if not u then return 1, 0, 0, 0, 0, override_commit end
  u = tonumber(u)
  if u ~= 0 and u <= now then return 1, 0, 0, 0, 0, override_commit end
  k = tonumber(k)
  override_next = { k, tonumber(p1), tonumber(p2), tonumber(p3), tonumber(p4), u }
  local code = 1
  if k == 2 then code = 2 elseif k == 0 then code = 3 + tonumber(cap) end
  return 1, code, 0, 0, 0, override_commit
end

-- Unlimited: allowed, nothing written.
local function override_pass()
  return 1, 0, 0, 0, 0, override_commit
end

-- Blocked: denied until p1 (µs; its wait is p2 when there is no expiry).
local function override_block(_, now, until_us, forever)
  local wait = forever
  if until_us ~= 0 then wait = until_us - now end
  return 0, 0, wait, wait, 0, nil
end

-- The spec t of the tier after an override check, as the override read
-- says (and the read consumed).
-- Under another quota the tier's values are tagged with it, and values in
-- the home forms read as the tier's configured quota's: t[14], or, for a
-- tier at its configured quota, that quota's unit or window (a calendar
-- keeps its boundaries: only its limit changes, so nothing is tagged).
local function override_apply(t)
  local o = override_next
  override_next = false
  if o[1] == 0 and t[1] == calendar then
    -- A calendar tier keeps its boundaries: the override (a fixed window
    -- of the tier's nominal length) gives its limit. (t[11]: a key listed
    -- again is charged again under the override too, dispatch.lua.)
    return { t[1], o[2], t[3], t[4], t[5], t[6], t[7], t[8], nil, nil, t[11], nil, nil, t[14] }
  elseif o[1] == 0 then
    -- The configured unit (buckets: p3) or window length (windows: p2),
    -- and the override's: nil (untagged) when they are the same.
    local i = 3
    if t[1] == token_bucket or t[1] == leaky_bucket then i = 4 end
    local home = t[14] or t[i]
    if o[i] == home then home = nil end
    return { t[1], o[2], o[3], o[4], o[5], t[6], t[7], t[8], nil, nil, t[11], nil, nil, home }
  elseif o[1] == 1 then
    return { override_pass, 0, 0, 0, 0, t[6], t[7], t[8] }
  end
  return { override_block, o[6], 86400000000, 0, 0, t[6], t[7], t[8] }
end

-- Nothing to give back (lua/cluster.lua's refund mode).
local function override_refund() end

-- lua/cluster.lua's refund mode: the override's read (its key's value,
-- read now) before a refund or a debt of its tier, as in a check.
local function override_read(key, now)
  override(nil, now, 0, 0, 0, 0, 0, rcall('GET', key), 0)
end

-- The parameters p1..p4 of a refund or debt of algorithm `alg` after an
-- override's read (which it consumes): another quota's (a calendar tier,
-- algorithm 9, keeps its boundaries and takes the override's limit), as
-- override_apply; the tier's own under unlimited or blocked, and without
-- an override. Twin: Active::limit_of in src/backend/override_rule.rs.
local function override_params(alg, p1, p2, p3, p4)
  local o = override_next
  override_next = false
  if not o or o[1] ~= 0 then return p1, p2, p3, p4 end
  if alg == 9 then return o[2], p2, p3, p4 end
  return o[2], o[3], o[4], o[5]
end
