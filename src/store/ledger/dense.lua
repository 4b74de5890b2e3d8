-- Marks a far hour dense and moves what its shards hold into their seconds' hashes, about a
-- refinement's batch per call (run after `ledger/bucket.lua` and `ledger/far_shard.lua`). KEYS:
-- as `ledger/far.lua`'s. ARGV: the seconds' prefix, the far buckets' prefix, a bucket's width
-- (ms), the hour, about how many deadlines to move at most. Returns whether its shards still hold
-- some (1 or 0).
--
-- A dense hour's seconds' hashes hold dozens of deadlines each, as cheap per key as its shards
-- (docs/how-it-works.md#dense-hours), and a writer can name a second's hash without reading
-- anything, so the deadlines of a dense hour are written with plain `HSET`s, no script. That is
-- safe only because the mark never goes back: its shard count is made negative here and stays so
-- until the hour is refined, when the frontier (read by `ledger/far.lua`) sends its writes to its
-- seconds anyway. A writer that has not seen the mark still writes through `ledger/far.lua`,
-- which reads it. The count keeps its size: until the shards are empty (this script, called again,
-- or the hour's refinement) a removal still looks in the shard the key was written to. An hour
-- with no far deadline yet is marked too, and listed with the far hours so that its refinement
-- clears the mark.
local pre, far_pre = ARGV[1], ARGV[2]
local width, b, most = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local frontier = tonumber(redis.call('GET', KEYS[3])) or -1
if b <= frontier then return 0 end
local n = tonumber(redis.call('HGET', KEYS[2], b))
if not n then
  redis.call('HSET', KEYS[2], b, -1)
  redis.call('ZADD', KEYS[1], b * width, b)
  return 0
end
if n > 0 then
  redis.call('HSET', KEYS[2], b, -n)
  -- Only splits read the hour's key count, and a dense hour no longer splits.
  redis.call('HDEL', KEYS[5], b)
end
local _, left = far_drain(b, far_shards(n), most, far_pre, width, pre, KEYS[4])
return left and 1 or 0
