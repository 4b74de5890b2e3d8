-- Takes the held groups due in KEYS[1] (the index of held groups: each group's member scored
-- with its quiet period's end, or with the end of the lease of whoever is releasing it) at
-- ARGV[1] (now, ms), at most ARGV[3] of them, leasing each until ARGV[2]. That lease end is
-- the taker's token: a later taker (after the lease ran out) writes a later one, so the first
-- can tell it lost the group. Returns the members taken.
local due = redis.call('ZRANGE', KEYS[1], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[3]))
for _, member in ipairs(due) do
  redis.call('ZADD', KEYS[1], 'XX', ARGV[2], member)
end
return due
