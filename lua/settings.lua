-- Fleet-wide settings (src/engine/settings.rs): replaces the settings
-- document of the control hash if its version is still the one the writer
-- read (a compare-and-set: two writers never lose each other's change).
--
-- KEYS[1]  the control hash
-- ARGV[1]  the version the writer read (0: none stored)
-- ARGV[2]  the new document (JSON; "" removes it: the configured settings)
--
-- Fields written together: `settings` (the document) and
-- `settings_version` (the read version + 1). Answers the new version, or
-- -1 - <the version found> when another write came first (the writer reads
-- again and retries); a `settings_version` that is not a whole number
-- answers -1 (the writer reports it: an operator wrote it by hand).
local found = redis.call('HGET', KEYS[1], 'settings_version')
local version = 0
if found then
  version = tonumber(found)
  if not version or version < 0 or version % 1 ~= 0 then return -1 end
end
if version ~= tonumber(ARGV[1]) then return -1 - version end
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[1], 'settings')
else
  redis.call('HSET', KEYS[1], 'settings', ARGV[2])
end
redis.call('HSET', KEYS[1], 'settings_version', version + 1)
return version + 1
