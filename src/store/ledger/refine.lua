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
-- neither; a removal between two calls looks in both. A deadline the second's hash holds
-- already was written there later than the shard's (writes go there once the hour is near), and
-- is kept (`HSETNX`).
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
  local n = tonumber(redis.call('HGET', KEYS[2], b)) or 0
  local done = true
  for j = 0, n - 1 do
    local name = far_pre .. b .. ':' .. j
    if moved >= most then
      if redis.call('EXISTS', name) == 1 then
        done = false
        break
      end
    else
      local rows = redis.call('HGETALL', name)
      local lows = {}
      for x = 1, #rows, 2 do
        local k = rows[x]
        local d = b * width + tonumber(rows[x + 1])
        local s = math.floor(d / 1000)
        redis.call('HSETNX', bucket(pre, s, k), k, d - s * 1000)
        local m = math.floor(s / 60)
        if not lows[m] or d < lows[m] then lows[m] = d end
      end
      for m, d in pairs(lows) do redis.call('ZADD', KEYS[4], 'LT', d, m) end
      if #rows > 0 then redis.call('DEL', name) end
      moved = moved + #rows / 2
    end
  end
  if not done then
    more = 1
    break
  end
  redis.call('HDEL', KEYS[2], b)
  redis.call('HDEL', KEYS[5], b)
  redis.call('ZREM', KEYS[1], b)
end
local next = redis.call('ZRANGE', KEYS[1], '-inf', '+inf', 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
return { more, next[2] and tonumber(next[2]) or -1 }
