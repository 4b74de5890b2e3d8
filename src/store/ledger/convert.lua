-- Converts up to ARGV[2] entries of an earlier keywatch's ledger (one sorted set per
-- database, member the key, score the deadline) to the compact form (run after
-- `ledger/bucket.lua`; docs/operations.md#upgrading). KEYS: the old sorted set, the minutes.
-- ARGV: the buckets' prefix, how many. Returns how many entries the old set still holds.
-- Moving a batch is atomic, so a deadline is in one form or the other, never lost.
local pre, n = ARGV[1], tonumber(ARGV[2])
if redis.call('TYPE', KEYS[1]).ok ~= 'zset' then return 0 end
local rows = redis.call('ZRANGE', KEYS[1], 0, n - 1, 'WITHSCORES')
local lows = {}
local members = {}
for i = 1, #rows, 2 do
  local k, d = rows[i], tonumber(rows[i + 1])
  local s = math.floor(d / 1000)
  redis.call('HSET', bucket(pre, s, k), k, d - s * 1000)
  local m = math.floor(s / 60)
  if not lows[m] or d < lows[m] then lows[m] = d end
  members[#members + 1] = k
end
for m, d in pairs(lows) do redis.call('ZADD', KEYS[2], 'LT', d, m) end
chunked(members, 1, #members, 1000, function(...) redis.call('ZREM', KEYS[1], ...) end)
return redis.call('ZCARD', KEYS[1])
