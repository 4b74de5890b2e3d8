-- Writes deadlines of fields of one hash (run after `ledger/bucket.lua`). KEYS: the hash's
-- index (field -> deadline), the field ledger's minutes, and for a hash whose name is long the
-- key its name is kept in. ARGV: the field ledger's hashes (without their second), then
-- field/member/deadline triples: a deadline of -1 forgets the field. Answers -1, writing
-- nothing, when a long hash's name is not kept (the caller keeps it and writes again); 0 once
-- written.
--
-- The index is where a field's deadline is found, so it moves with it: the old second's hash
-- loses the member when the deadline leaves that second or the field is forgotten. While a long
-- hash's index holds a field its name is kept for good (an upload of it expires): the name
-- leaves with the last field, here or in the take (`store/intake/take.lua`).
local name = KEYS[3]
local pre = ARGV[1]
if name then
  local adds = false
  for i = 4, #ARGV, 3 do
    if tonumber(ARGV[i]) > 0 then adds = true end
  end
  if adds then
    if redis.call('EXISTS', name) == 0 then return -1 end
    redis.call('PERSIST', name)
  end
end
for i = 2, #ARGV, 3 do
  local f, m, d = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local old = redis.call('HGET', KEYS[1], f)
  local s = d > 0 and math.floor(d / 1000) or nil
  if old then
    local was = math.floor(tonumber(old) / 1000)
    if was ~= s then redis.call('HDEL', bucket(pre, was, m), m) end
  end
  if s then
    redis.call('HSET', bucket(pre, s, m), m, d - s * 1000)
    redis.call('HSET', KEYS[1], f, d)
    redis.call('ZADD', KEYS[2], 'LT', d, math.floor(s / 60))
  else
    redis.call('HDEL', KEYS[1], f)
  end
end
if name and redis.call('HLEN', KEYS[1]) == 0 then redis.call('DEL', name) end
return 0
