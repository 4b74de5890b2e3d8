-- The ledger's far buckets (docs/how-it-works.md#far-deadlines), put after `ledger/bucket.lua`
-- in front of the scripts that read or write them. A deadline further ahead than the poker
-- refines lives in the bucket of the hour it falls in, `FAR .. HOUR .. ':' .. SHARD` (field:
-- the key, value: the milliseconds within that hour), not in the hash of its second: sparse
-- seconds cost a whole Redis key per deadline. A bucket's shard count follows its density
-- (linear hashing, Litwin 1980): it starts at one, and when a shard passes the split size the
-- next shard in turn is split in two, so every shard stays a listpack of a few dozen to a hundred
-- keys. The count is kept in Redis (`counts`, bucket → shards) and read in the same script as
-- the write or removal it decides, so every instance names the same shard for a key.

-- A key's 32-bit hash: the first 8 hex digits of its SHA-1 (the same on every instance).
local far_hashes = {}
local function far_hash(key)
  local h = far_hashes[key]
  if not h then
    h = tonumber(string.sub(redis.sha1hex(key), 1, 8), 16)
    far_hashes[key] = h
  end
  return h
end
-- The largest power of two no greater than n.
local function far_p2(n)
  local p2 = 1
  while p2 * 2 <= n do p2 = p2 * 2 end
  return p2
end
-- The shard of `key` in a bucket of n shards (linear hashing).
local function far_shard(n, key)
  local h = far_hash(key)
  local p2 = far_p2(n)
  local j = h % (2 * p2)
  if j >= n then j = h % p2 end
  return j
end
