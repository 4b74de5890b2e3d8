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
-- An hour's shard count is kept negative once the hour is dense (`ledger/dense.lua`): its
-- shards take no more deadlines and never split again, but may still hold some until they are
-- moved, so removals and refinements still look in that many.
local function far_shards(n)
  return math.abs(n)
end
-- Moves the shard `name` of hour b whole into its deadlines' seconds' hashes (`pre`), the
-- minutes (`minutes`) lowered as any writer does, and returns how many it moved. A deadline a
-- second's hash holds already was written there later than the shard's copy (writes of an hour
-- go to its seconds once it is dense or near) and is kept (`HSETNX`).
local function far_move(name, b, width, pre, minutes)
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
  for m, d in pairs(lows) do redis.call('ZADD', minutes, 'LT', d, m) end
  if #rows > 0 then redis.call('DEL', name) end
  return #rows / 2
end
-- Moves the shards of hour b (n of them) into their seconds, whole ones, until about `most`
-- deadlines moved: returns how many moved and whether some shard is left.
local function far_drain(b, n, most, far_pre, width, pre, minutes)
  local moved = 0
  for j = 0, n - 1 do
    local name = far_pre .. b .. ':' .. j
    if moved >= most then
      if redis.call('EXISTS', name) == 1 then return moved, true end
    else
      moved = moved + far_move(name, b, width, pre, minutes)
    end
  end
  return moved, false
end
