-- Trims history's index (see `store/history.rs` and
-- docs/how-it-works.md#keywatchs-own-keys): the entries whose newest firing was observed before
-- the cut go, then the oldest entries until it holds at most `max` firings. An entry is a group
-- (`@MINUTE:TOKEN`, then a line per firing) or, written before groups, one firing (its id).
-- The index holds ZCARD entries and KEYS[2]'s field `n` more firings (each group's firings
-- less one), kept right here, in one step, whichever instance trims. Returns the entries trimmed
-- by count, with their scores, for their fields to be removed (those trimmed by time go with
-- their minute's hash).
--
-- KEYS: the index, its count of firings beyond one per entry. ARGV: the cut (ms), max.
local index, extra_key = KEYS[1], KEYS[2]
local cut, max = ARGV[1], tonumber(ARGV[2])
local extra = tonumber(redis.call('HGET', extra_key, 'n') or '0')
-- The firings of an entry beyond its first.
local function more(member)
  if string.byte(member, 1) ~= 64 then return 0 end
  local _, lines = string.gsub(member, '\n', '')
  return math.max(lines - 1, 0)
end
local old = redis.call('ZRANGE', index, '-inf', '(' .. cut, 'BYSCORE')
for i = 1, #old, 1000 do
  local part = {}
  for j = i, math.min(i + 999, #old) do
    part[#part + 1] = old[j]
    extra = extra - more(old[j])
  end
  redis.call('ZREM', index, unpack(part))
end
local trimmed = {}
local n = redis.call('ZCARD', index)
while n > 0 and n + extra > max do
  local o = redis.call('ZPOPMIN', index)
  trimmed[#trimmed + 1] = o[1]
  trimmed[#trimmed + 1] = o[2]
  extra = extra - more(o[1])
  n = n - 1
end
if extra < 0 then extra = 0 end
redis.call('HSET', extra_key, 'n', extra)
return trimmed
