-- Takes the oldest jobs of the waiting set KEYS[1] back into the queue KEYS[2], leased until
-- ARGV[2], as many as fit in ARGV[1] (a bundle counts as the jobs it holds: see `bundle`); one
-- bigger than that is taken alone when ARGV[4] says the target is idle (its free places are all
-- there is), so that a bundle made for a target of higher concurrency still goes. An emptied set
-- leaves the list KEYS[3] (its name there is ARGV[3]). Returns how many members are left, the
-- members taken and how many jobs the oldest member left behind holds (0: none was too big), so
-- that the caller need not ask again until it has that many free places: the payloads are read
-- after it with a plain `HMGET` (leased to this instance, they stay). Passing them through the
-- script (into Lua and back out as its answer) cost more than the moves.
local free = tonumber(ARGV[1])
local seen = redis.call('ZRANGE', KEYS[1], 0, free - 1)
local ids = {}
local jobs = 0
local need = 0
for _, id in ipairs(seen) do
  local n = tonumber(string.match(id, '^#(%d+)#')) or 1
  if jobs + n > free and not (jobs == 0 and ARGV[4] == '1') then
    need = n
    break
  end
  ids[#ids + 1] = id
  jobs = jobs + n
end
if #ids == 0 then
  local left = redis.call('ZCARD', KEYS[1])
  if left == 0 then redis.call('SREM', KEYS[3], ARGV[3]) end
  return {left, {}, need}
end
-- A command each way per thousand members (one per job cost more than the moves themselves).
for j = 1, #ids, 1000 do
  local last = math.min(j + 999, #ids)
  redis.call('ZREM', KEYS[1], unpack(ids, j, last))
  local leased = {}
  for i = j, last do
    leased[#leased + 1] = ARGV[2]
    leased[#leased + 1] = ids[i]
  end
  redis.call('ZADD', KEYS[2], unpack(leased))
end
local left = redis.call('ZCARD', KEYS[1])
if left == 0 then
  redis.call('SREM', KEYS[3], ARGV[3])
end
return {left, ids, need}
