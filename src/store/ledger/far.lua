-- Removes and writes deadlines where the far buckets may hold them (run after
-- `ledger/bucket.lua` and `ledger/far_shard.lua`). KEYS: the far buckets (a sorted set of hours,
-- scored by their start), their shard counts, the frontier (the latest hour the poker began
-- to refine), the minutes, each hour's key count. ARGV: the seconds' prefix, the far buckets'
-- prefix, a bucket's width (ms), the load factor (keys per shard), how many removals, then that
-- many second/key/hash triples (the second a deadline was known in, the key's `far_hash`), then
-- deadline/key/hash triples to write. Returns the dense hours it met (below).
--
-- A deadline is in exactly one place: its second's hash, or the shard of its hour that the
-- hour's shard count names; both are read here, atomically with the write, so a removal removes
-- it wherever it is. An hour the poker began to refine (at or before the frontier) takes no new
-- far deadlines: they go to their second's hash, and so does a long key's (its own shard's
-- listpack would become a hashtable, as a second's `:long` hash is kept apart). Nor does an hour
-- marked dense (its shard count negative, `ledger/dense.lua`): its deadlines go to their
-- seconds' hashes for good, and the caller, told so, writes them there itself from then on,
-- without a script.
--
-- What Redis does per far key is one `HSET`: the hash comes in with the key, and an hour's key
-- count (KEYS[5]) is moved once per script (`HINCRBY`), not a shard's length read after every
-- write (`HLEN`); splits follow the hour's count (docs/performance.md, "Learning far deadlines").
local pre, far_pre = ARGV[1], ARGV[2]
local width, load = tonumber(ARGV[3]), tonumber(ARGV[4])
local removals = tonumber(ARGV[5])
local frontier = tonumber(redis.call('GET', KEYS[3])) or -1
local counts = {}
local function count(b)
  local n = counts[b]
  if n == nil then
    n = tonumber(redis.call('HGET', KEYS[2], b)) or false
    counts[b] = n
  end
  return n
end
-- Splits the next shard of hour b in turn (linear hashing): its keys whose hash names the new
-- shard move there. Each key moves about once as its hour fills, so hashing here is cheap.
local function split(b)
  local n = counts[b]
  local p2 = far_p2(n)
  local from, to = far_pre .. b .. ':' .. (n - p2), far_pre .. b .. ':' .. n
  local rows = redis.call('HGETALL', from)
  local moved, gone = {}, {}
  for x = 1, #rows, 2 do
    if far_hash(rows[x]) % (2 * p2) == n then
      moved[#moved + 1] = rows[x]
      moved[#moved + 1] = rows[x + 1]
      gone[#gone + 1] = rows[x]
    end
  end
  if #gone > 0 then
    redis.call('HSET', to, unpack(moved))
    redis.call('HDEL', from, unpack(gone))
  end
  counts[b] = n + 1
  redis.call('HSET', KEYS[2], b, n + 1)
end
local first = 6
local last_removal = first + 3 * removals - 1
local dense, met = {}, {}
-- Every hour's shard count read at once: a fill's page of a thousand keys spread over a year
-- touches nearly a thousand hours.
do
  local hours, seen = {}, {}
  for i = first, #ARGV, 3 do
    local b
    if i <= last_removal then
      b = math.floor(tonumber(ARGV[i]) * 1000 / width)
    else
      b = math.floor(tonumber(ARGV[i]) / width)
    end
    if b > frontier and not seen[b] then
      seen[b] = true
      hours[#hours + 1] = b
    end
  end
  for j = 1, #hours, 1000 do
    local last = math.min(j + 999, #hours)
    local got = redis.call('HMGET', KEYS[2], unpack(hours, j, last))
    for x = j, last do
      local n = tonumber(got[x - j + 1]) or false
      counts[hours[x]] = n
      if n and n < 0 and not met[hours[x]] then
        met[hours[x]] = true
        dense[#dense + 1] = hours[x]
      end
    end
  end
end
-- How many keys each hour gained here (removals count down), and the hours in the order met.
local added, touched = {}, {}
local function add(b, x)
  if not added[b] then
    added[b] = 0
    touched[#touched + 1] = b
  end
  added[b] = added[b] + x
end
for i = first, last_removal, 3 do
  local s, k = tonumber(ARGV[i]), ARGV[i + 1]
  redis.call('HDEL', bucket(pre, s, k), k)
  if not long_key(k) then
    local b = math.floor(s * 1000 / width)
    local n = count(b)
    if n then
      local name = far_pre .. b .. ':' .. far_shard(far_shards(n), tonumber(ARGV[i + 2]))
      local x = redis.call('HDEL', name, k)
      if n > 0 then add(b, -x) end
    end
  end
end
local lows = {}
-- Each hour's shard names' prefix and its count's power of two, made once per script, not per
-- key: the loop below is what Redis spends per far key besides the `HSET`.
local prefixes, p2s = {}, {}
local call, floor = redis.call, math.floor
for i = last_removal + 1, #ARGV, 3 do
  local d, k = tonumber(ARGV[i]), ARGV[i + 1]
  local b = floor(d / width)
  if b <= frontier or long_key(k) or (counts[b] and counts[b] < 0) then
    local s = floor(d / 1000)
    call('HSET', bucket(pre, s, k), k, d - s * 1000)
    local m = floor(s / 60)
    if not lows[m] or d < lows[m] then lows[m] = d end
  else
    local n = counts[b]
    if not n then
      n = 1
      counts[b] = 1
      call('HSET', KEYS[2], b, 1)
      call('ZADD', KEYS[1], b * width, b)
    end
    local hp = prefixes[b]
    if not hp then
      hp = far_pre .. b .. ':'
      prefixes[b] = hp
      p2s[b] = far_p2(n)
    end
    local j = far_shard_p2(n, p2s[b], tonumber(ARGV[i + 2]))
    local x = call('HSET', hp .. j, k, d - b * width)
    local was = added[b]
    if was then
      added[b] = was + x
    else
      add(b, x)
    end
  end
end
-- Past the load factor an hour's shards would soon stop being listpacks: split shards in turn
-- until the hour holds no more than that many keys per shard.
for _, b in ipairs(touched) do
  if added[b] ~= 0 then
    local keys = redis.call('HINCRBY', KEYS[5], b, added[b])
    if added[b] > 0 then
      while keys > load * counts[b] do split(b) end
    end
  end
end
for m, d in pairs(lows) do redis.call('ZADD', KEYS[4], 'LT', d, m) end
return dense
