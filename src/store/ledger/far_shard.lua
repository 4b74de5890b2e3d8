-- The ledger's far buckets (docs/how-it-works.md#far-deadlines), put after `ledger/bucket.lua`
-- in front of the scripts that read or write them. A deadline further ahead than the poker
-- refines lives in the bucket of the hour it falls in, `FAR .. HOUR .. ':' .. SHARD` (field:
-- the key, value: the milliseconds within that hour), not in the hash of its second: sparse
-- seconds cost a whole Redis key per deadline. A bucket's shard count follows its density
-- (linear hashing, Litwin 1980): it starts at one, and when the hour holds more keys than the
-- load factor times its shards, the next shard in turn is split in two, so every shard stays a
-- listpack of about a hundred keys. The count is kept in Redis (bucket → shards, and bucket →
-- keys) and read in the same script as the write or removal it decides, so every
-- instance names the same shard for a key.

-- A key's hash, below 2^32: its bytes as a polynomial modulo the prime 4294967291, base
-- 1000003. Every product stays below 2^52, exact in Lua's doubles, and the same in
-- `store::ledger::far_hash`: writers pass it in (hashing in Lua costs Redis's one thread), a
-- split computes it here for the keys it moves.
local function far_hash(key)
  local h = 0
  for i = 1, #key do
    h = (h * 1000003 + string.byte(key, i)) % 4294967291
  end
  return h
end
-- The largest power of two no greater than n.
local function far_p2(n)
  local p2 = 1
  while p2 * 2 <= n do p2 = p2 * 2 end
  return p2
end
-- The shard of a key hashed `h` in a bucket of n shards, p2 the largest power of two no greater
-- than n (linear hashing): a writer of many keys finds p2 once per hour.
local function far_shard_p2(n, p2, h)
  local j = h % (2 * p2)
  if j >= n then j = h % p2 end
  return j
end
-- The shard of a key hashed `h` in a bucket of n shards.
local function far_shard(n, h)
  return far_shard_p2(n, far_p2(n), h)
end
