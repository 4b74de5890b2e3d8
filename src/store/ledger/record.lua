-- Records read deadlines due within a minute (run after `ledger/bucket.lua`; later ones cannot
-- have been taken yet and are written without it, `Deadlines::record`). KEYS[1]: the minutes.
-- ARGV: the clock slack, the handled memory's name without its minute, the current minute, how
-- many minutes it goes back, the buckets' prefix, then deadline/key pairs sorted by their hash
-- (second, then long keys after short ones).
--
-- A deadline goes in unless the handled memory says this incarnation's expiry was taken
-- already, either with that very deadline (or a later one) or, as `~T`, without a known
-- deadline at T; a deadline at or before T (plus clock slack) belonged to the key that expired
-- then. Written back, it would be found gone by the poker and recovered, or taken a second time
-- by an instance that hears the same `expired` later. Keys without a TTL, and the hashes a
-- deadline leaves, are the caller's: removed beside this script.
--
-- The handled memory is read with one HMGET per minute that has one, and the writes go as one
-- HSET per hash, in the order given, without a table per hash.
local slack = tonumber(ARGV[1])
local memory, minute, minutes = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local pre = ARGV[5]
local first = 6
local recent = {}
for m = minute, minute - minutes, -1 do
  if redis.call('EXISTS', memory .. m) == 1 then recent[#recent + 1] = memory .. m end
end
-- What the handled memory holds for each key (by its place among the pairs): the newest minute
-- that has it.
local held = {}
if #recent > 0 then
  local keys = {}
  for i = first + 1, #ARGV, 2 do keys[#keys + 1] = ARGV[i] end
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
-- The current hash's fields and values, written when the next pair names another hash; its
-- second, whether it holds long keys, and the minute's lowest deadline so far.
local run, n, name = {}, 0, nil
local cur_s, cur_long = nil, nil
local bounds, low, low_minute = {}, nil, nil
local function flush()
  if n > 0 then redis.call('HSET', name, unpack(run, 1, n)) end
  n = 0
end
local j = 0
for i = first, #ARGV, 2 do
  j = j + 1
  local d, k = tonumber(ARGV[i]), ARGV[i + 1]
  local h = held[j]
  local stale = false
  if h then
    if string.sub(h, 1, 1) == '~' then
      stale = d <= tonumber(string.sub(h, 2)) + slack
    else
      stale = d <= tonumber(h)
    end
  end
  if not stale then
    local s = d - d % 1000
    local long = long_key(k)
    if s ~= cur_s or long ~= cur_long then
      flush()
      cur_s, cur_long = s, long
      name = bucket(pre, s / 1000, k)
      local m = math.floor(s / 60000)
      if m ~= low_minute then
        if low then
          bounds[#bounds + 1] = low
          bounds[#bounds + 1] = low_minute
        end
        low, low_minute = d, m
      end
    end
    if d < low then low = d end
    run[n + 1] = k
    run[n + 2] = d - s
    n = n + 2
  end
end
flush()
if low then
  bounds[#bounds + 1] = low
  bounds[#bounds + 1] = low_minute
end
-- Each minute's score is a lower bound of the deadlines its hashes hold (`LT`: never raised
-- here, only by the poker's read, which sees them all).
chunked(bounds, 1, #bounds, 2000, function(...) redis.call('ZADD', KEYS[1], 'LT', ...) end)
return 0
