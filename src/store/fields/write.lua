-- Writes deadlines of fields of one hash (run after `ledger/bucket.lua`). KEYS: the hash's
-- index (field -> deadline), the field ledger's minutes. ARGV: the field ledger's hashes
-- (without their second), then field/member/deadline triples: a deadline of -1 forgets the field.
--
-- The index is where a field's deadline is found, so it moves with it: the old second's hash
-- loses the member when the deadline leaves that second or the field is forgotten.
local pre = ARGV[1]
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
return 0
