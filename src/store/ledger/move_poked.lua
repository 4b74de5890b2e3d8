-- Moves touched-and-gone keys from the ledger to the poked set (run after `ledger/bucket.lua`),
-- but only if the ledger still holds the deadline the poker saw: if the engine handled the
-- `expired` in between, nothing moves. Entries are stamped with the next number of the
-- database's marker sequence, shared by every instance (see `Ledger::mark`); returns that number.
-- KEYS: the poked set, the poked deadlines, the marker sequence; ARGV: the buckets' prefix, then
-- key, deadline pairs as the poker saw them.
local pre = ARGV[1]
local seq = redis.call('INCR', KEYS[3])
-- Grouped by hash: a command each per hash and thousand keys, not per key (in a storm the
-- poker moves thousands at once, mostly from one second).
local groups, order = {}, {}
for i = 2, #ARGV, 2 do
  local k, d = ARGV[i], tonumber(ARGV[i + 1])
  local s = math.floor(d / 1000)
  local b = bucket(pre, s, k)
  local g = groups[b]
  if not g then
    g = { keys = {}, offsets = {}, deadlines = {} }
    groups[b] = g
    order[#order + 1] = b
  end
  g.keys[#g.keys + 1] = k
  g.offsets[#g.keys] = d - s * 1000
  g.deadlines[#g.keys] = ARGV[i + 1]
end
for _, b in ipairs(order) do
  local g = groups[b]
  for j = 1, #g.keys, 1000 do
    local last = math.min(j + 999, #g.keys)
    local held = redis.call('HMGET', b, unpack(g.keys, j, last))
    local moved, poked, deadlines = {}, {}, {}
    for n = j, last do
      local h = held[n - j + 1]
      if h and tonumber(h) == g.offsets[n] then
        moved[#moved + 1] = g.keys[n]
        poked[#poked + 1] = seq
        poked[#poked + 1] = g.keys[n]
        deadlines[#deadlines + 1] = g.keys[n]
        deadlines[#deadlines + 1] = g.deadlines[n]
      end
    end
    if #moved > 0 then
      redis.call('HDEL', b, unpack(moved))
      redis.call('ZADD', KEYS[1], unpack(poked))
      redis.call('HSET', KEYS[2], unpack(deadlines))
    end
  end
end
return seq
