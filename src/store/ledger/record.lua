-- Records read deadlines (ARGV[1] is the slack, ARGV[2] the handled memory's name without its
-- minute, ARGV[3] the current minute, ARGV[4] how many minutes it goes back, then deadline/key
-- pairs, in ZADD's order): a positive deadline goes in unless the handled memory says this incarnation's expiry
-- was taken already, either with that very deadline (or a later one) or, as `~T`, without a
-- known deadline at T; a deadline at or before T (plus clock slack) belonged to the key that
-- expired then. A key without a TTL (-1) leaves; a key already gone (-2) keeps whatever
-- deadline the ledger holds: its `expired` may have been lost, and the poker finds it gone and
-- recovers it, or the take of that `expired` removes it.
--
-- A fill records a thousand keys a call, so the writes go as one command per thousand keys and
-- the handled memory is read with one HMGET per minute that has one, not a command per key;
-- with no handled memory and every key with a TTL (a fill's usual call) the pairs go to ZADD as
-- they came, untouched by Lua (docs/performance.md#learning-a-big-keyspace).
local slack = tonumber(ARGV[1])
local memory, minute, minutes = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
-- Calls f with the elements of list from 1 to #list, at most step at a time (Lua's stack bounds
-- unpack).
local function chunked(list, step, f)
  for k = 1, #list, step do
    f(unpack(list, k, math.min(k + step - 1, #list)))
  end
end
local recent = {}
for m = minute, minute - minutes, -1 do
  if redis.call('EXISTS', memory .. m) == 1 then recent[#recent + 1] = memory .. m end
end
local plain = #recent == 0
if plain then
  for i = 5, #ARGV, 2 do
    if tonumber(ARGV[i]) <= 0 then
      plain = false
      break
    end
  end
end
if plain then
  -- ZADD keeps the last of a key given twice, as writing each pair in turn would.
  for k = 5, #ARGV, 2000 do
    redis.call('ZADD', KEYS[1], unpack(ARGV, k, math.min(k + 1999, #ARGV)))
  end
  return 0
end
-- A key given twice keeps its last deadline, as if each pair were written in turn (a gone key's
-- pair writes nothing).
local last = {}
for i = 6, #ARGV, 2 do
  if tonumber(ARGV[i - 1]) ~= -2 then last[ARGV[i]] = i end
end
local keys, deadlines, persistent = {}, {}, {}
for i = 6, #ARGV, 2 do
  local k = ARGV[i]
  if last[k] == i then
    local d = tonumber(ARGV[i - 1])
    if d > 0 then
      keys[#keys + 1] = k
      deadlines[#keys] = d
    elseif d == -1 then
      persistent[#persistent + 1] = k
    end
  end
end
-- What the handled memory holds for each key: the newest minute that has it.
local held = {}
if #keys > 0 then
  for _, hk in ipairs(recent) do
    local base = 0
    chunked(keys, 1000, function(...)
      local got = redis.call('HMGET', hk, ...)
      for j = 1, select('#', ...) do
        if got[j] and held[base + j] == nil then held[base + j] = got[j] end
      end
      base = base + select('#', ...)
    end)
  end
end
local add = {}
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
    add[#add + 1] = d
    add[#add + 1] = k
  end
end
chunked(add, 2000, function(...)
  redis.call('ZADD', KEYS[1], ...)
end)
chunked(persistent, 1000, function(...)
  redis.call('ZREM', KEYS[1], ...)
end)
return 0
