-- Refines the far buckets due soon into their seconds' hashes (run after `ledger/bucket.lua`),
-- earliest hour first, a shard at a time. KEYS: the far buckets, their shard counts, the
-- frontier, the minutes, each hour's key count. ARGV: the seconds' prefix, the far buckets' prefix, a bucket's width
-- (ms), the latest start of an hour to refine now, about how many deadlines to move at most.
-- Returns whether some are left to refine now (1 or 0), and the start of the earliest hour
-- still far (-1: none).
--
-- The frontier is moved to an hour before its first shard moves: from then on writes of that
-- hour go to its seconds' hashes, so nothing lands in a shard already refined. A shard moves
-- whole in one script, so each deadline is in its shard or in its second, never in both or
-- neither; a removal between two calls looks in both (`far_move`, `ledger/far_shard.lua`). An
-- hour marked dense (`ledger/dense.lua`) is refined alike, what its shards still hold.
local pre, far_pre = ARGV[1], ARGV[2]
local width, until_ms, most = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local moved = 0
local more = 0
while true do
  local first = redis.call('ZRANGE', KEYS[1], '-inf', until_ms, 'BYSCORE', 'LIMIT', 0, 1)
  if #first == 0 then break end
  local b = tonumber(first[1])
  local frontier = tonumber(redis.call('GET', KEYS[3]))
  if not frontier or b > frontier then redis.call('SET', KEYS[3], b) end
  local n = far_shards(tonumber(redis.call('HGET', KEYS[2], b)) or 0)
  local got, left = far_drain(b, n, most - moved, far_pre, width, pre, KEYS[4])
  moved = moved + got
  if left then
    more = 1
    break
  end
  redis.call('HDEL', KEYS[2], b)
  redis.call('HDEL', KEYS[5], b)
  redis.call('ZREM', KEYS[1], b)
end
local next = redis.call('ZRANGE', KEYS[1], '-inf', '+inf', 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
return { more, next[2] and tonumber(next[2]) or -1 }
