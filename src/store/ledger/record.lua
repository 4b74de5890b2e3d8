-- Records read deadlines (run after `ledger/bucket.lua`). KEYS[1]: the minutes. ARGV: the clock
-- slack, the handled memory's name without its minute, the current minute, how many minutes it
-- goes back, the buckets' prefix, then deadline/key/old-second triples: the deadline as
-- `PEXPIRETIME` answered it, and the second this instance last knew the key's deadline in
-- (empty if it knew none).
--
-- A positive deadline goes in unless the handled memory says this incarnation's expiry was taken
-- already, either with that very deadline (or a later one) or, as `~T`, without a known
-- deadline at T; a deadline at or before T (plus clock slack) belonged to the key that expired
-- then. A key without a TTL (-1) leaves; a key already gone (-2) keeps whatever deadline the
-- ledger holds: its `expired` may have been lost, and the poker finds it gone and recovers it,
-- or the take of that `expired` removes it. A deadline that moved to another second leaves the
-- old second's hash.
--
-- A fill records a thousand keys a call, so the writes go as one command per hash and minute,
-- and the handled memory is read with one HMGET per minute that has one
-- (docs/performance.md#learning-a-big-keyspace).
local slack = tonumber(ARGV[1])
local memory, minute, minutes = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local pre = ARGV[5]
local first = 6
local recent = {}
for m = minute, minute - minutes, -1 do
  if redis.call('EXISTS', memory .. m) == 1 then recent[#recent + 1] = memory .. m end
end
-- Writes grouped by hash: name -> list of fields (and values, for adds), in first-seen order.
local dels, del_order = {}, {}
local adds, add_order = {}, {}
local lows = {}
local function push(groups, order, name, ...)
  local g = groups[name]
  if not g then
    g = {}
    groups[name] = g
    order[#order + 1] = name
  end
  for i = 1, select('#', ...) do g[#g + 1] = select(i, ...) end
end
-- The keys with a positive deadline, to be added unless the handled memory says otherwise.
local keys, deadlines = {}, {}
for i = first, #ARGV, 3 do
  local d, k, old = tonumber(ARGV[i]), ARGV[i + 1], ARGV[i + 2]
  if d ~= -2 then
    local s = d > 0 and math.floor(d / 1000) or nil
    if old ~= '' and tonumber(old) ~= s then push(dels, del_order, bucket(pre, old, k), k) end
    if s then
      keys[#keys + 1] = k
      deadlines[#keys] = d
    end
  end
end
-- What the handled memory holds for each key: the newest minute that has it.
local held = {}
if #keys > 0 then
  for _, hk in ipairs(recent) do
    local base = 0
    chunked(keys, 1, #keys, 1000, function(...)
      local got = redis.call('HMGET', hk, ...)
      for j = 1, select('#', ...) do
        if got[j] and held[base + j] == nil then held[base + j] = got[j] end
      end
      base = base + select('#', ...)
    end)
  end
end
for j, k in ipairs(keys) do
  local d, h = deadlines[j], held[j]
  local stale = false
  if h then
    if string.sub(h, 1, 1) == '~' then
      stale = d <= tonumber(string.sub(h, 2)) + slack
    else
      stale = d <= tonumber(h)
    end
  end
  if not stale then
    local s = math.floor(d / 1000)
    push(adds, add_order, bucket(pre, s, k), k, d - s * 1000)
    local m = math.floor(s / 60)
    if not lows[m] or d < lows[m] then lows[m] = d end
  end
end
for _, b in ipairs(del_order) do
  local g = dels[b]
  chunked(g, 1, #g, 1000, function(...) redis.call('HDEL', b, ...) end)
end
for _, b in ipairs(add_order) do
  local g = adds[b]
  chunked(g, 1, #g, 2000, function(...) redis.call('HSET', b, ...) end)
end
-- Each minute's score is a lower bound of the deadlines its hashes hold (`LT`: never raised
-- here, only by the poker's read, which sees them all).
local bounds = {}
for m, d in pairs(lows) do
  bounds[#bounds + 1] = d
  bounds[#bounds + 1] = m
end
chunked(bounds, 1, #bounds, 2000, function(...) redis.call('ZADD', KEYS[1], 'LT', ...) end)
return 0
