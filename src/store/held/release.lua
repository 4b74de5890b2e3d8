-- Records (part of) the release of a held group, only for whoever holds its lease: removes the
-- messages released (and their resolved marks), writes what the caller puts in their place
-- (jobs into the queue: members of sorted sets with their payloads in hashes) in the same
-- step, so that a crash leaves either the held messages or what replaces them, never both or
-- neither.
-- KEYS[1]: the index of held groups; KEYS[2]: the group's messages (id → payload); KEYS[3]: its
-- resolved marks; KEYS[4..]: the sorted sets and hashes the entries go in.
-- ARGV[1]: the group's member; ARGV[2]: the taker's token (its lease end); ARGV[3]: now (ms);
-- ARGV[4]: '1' for the last part of the release; ARGV[5]: how many ids follow, then the ids
-- released; then, per entry: the index in KEYS of its sorted set and of its hash, its id, its
-- payload and its score (NX both: an entry already there keeps its place and payload).
-- Returns -1 when the lease is another's (nothing written), else how many messages are left.
-- After the last part, a group still holding messages (held while it was being released) is
-- due again at once; an empty one leaves the index.
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) ~= tonumber(ARGV[2]) then
  return -1
end
local n = tonumber(ARGV[5])
local first = 6
-- In slices: unpack() of too many values overflows Lua's stack.
local i = first
while i < first + n do
  local last = math.min(i + 999, first + n - 1)
  redis.call('HDEL', KEYS[2], unpack(ARGV, i, last))
  redis.call('SREM', KEYS[3], unpack(ARGV, i, last))
  i = last + 1
end
i = first + n
while i <= #ARGV do
  redis.call('HSETNX', KEYS[tonumber(ARGV[i + 1])], ARGV[i + 2], ARGV[i + 3])
  redis.call('ZADD', KEYS[tonumber(ARGV[i])], 'NX', ARGV[i + 4], ARGV[i + 2])
  i = i + 5
end
local left = redis.call('HLEN', KEYS[2])
if ARGV[4] == '1' then
  if left == 0 then
    redis.call('DEL', KEYS[3])
    redis.call('ZREM', KEYS[1], ARGV[1])
  else
    redis.call('ZADD', KEYS[1], 'XX', ARGV[3], ARGV[1])
  end
end
return left
