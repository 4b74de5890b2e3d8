-- Moves touched-and-gone keys from the ledger to the poked set, but only if the ledger still
-- holds the deadline the poker saw: if the engine handled the `expired` in between, nothing moves.
-- Entries are stamped with the next number of the database's marker sequence, shared by every
-- instance (see `Ledger::mark`); returns that number.
-- KEYS: the ledger, the poked set, the poked deadlines, the marker sequence; ARGV: key,
-- deadline pairs as the poker saw them.
local seq = redis.call('INCR', KEYS[4])
-- A command each per thousand keys, not per key: in a storm the poker moves thousands at once.
for j = 1, #ARGV, 2000 do
  local last = math.min(j + 1999, #ARGV)
  local members = {}
  for i = j, last, 2 do
    members[#members + 1] = ARGV[i]
  end
  local scores = redis.call('ZMSCORE', KEYS[1], unpack(members))
  local moved, poked, deadlines = {}, {}, {}
  for n, m in ipairs(members) do
    local given = ARGV[j + 2 * (n - 1) + 1]
    if scores[n] and tonumber(scores[n]) == tonumber(given) then
      moved[#moved + 1] = m
      poked[#poked + 1] = seq
      poked[#poked + 1] = m
      deadlines[#deadlines + 1] = m
      deadlines[#deadlines + 1] = given
    end
  end
  if #moved > 0 then
    redis.call('ZREM', KEYS[1], unpack(moved))
    redis.call('ZADD', KEYS[2], unpack(poked))
    redis.call('HSET', KEYS[3], unpack(deadlines))
  end
end
return seq
