-- A tier's fall back guard (src/engine/rollout/guard.rs): each instance's
-- flush of its counts since its last poll into the fleet's bucket, the
-- guard's lease, and the read of the bucket being judged. A function of
-- lua/poll.lua (`guard_part`), a part of the instance's one call a poll.
--
-- KEYS[1]  the bucket to add to: a hash, {<control>}:guard:<tier>:<bucket>
-- KEYS[2]  the bucket being judged (an earlier one, same form)
-- KEYS[3]  the guard's lease, {<control>}:guard:<tier>:lease
-- ARGV[1]  the calling instance's id
-- ARGV[2]  the lease, in ms
-- ARGV[3]  a bucket's lifetime, in s
-- ARGV[4..10] the counts: checked limited shadow denied_keys top ms cohort
--
-- Answers {lead, fields}: lead 1 when the caller holds the lease (it had
-- it, or nobody had), then the judged bucket's fields (HGETALL).

local names = {'checked', 'limited', 'shadow', 'denied_keys', 'top', 'ms', 'cohort'}
local any = false
for i, name in ipairs(names) do
  local v = tonumber(ARGV[3 + i])
  if v and v > 0 then
    redis.call('HINCRBY', KEYS[1], name, v)
    any = true
  end
end
if any then redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3])) end
local lead = 0
local holder = redis.call('GET', KEYS[3])
if (not holder) or holder == ARGV[1] then
  redis.call('SET', KEYS[3], ARGV[1], 'PX', tonumber(ARGV[2]))
  lead = 1
end
return {lead, redis.call('HGETALL', KEYS[2])}
