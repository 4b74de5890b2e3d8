-- Moves dead letters back into the queue, each exactly once: a letter's entries (members of
-- the queue, or of a digest window, due at once) are written only by whoever removes the
-- letter from the dead letters' hash KEYS[1] (and its place in the index KEYS[2]), in the same
-- script. KEYS[3] holds the payloads, KEYS[4] lists the windows, KEYS[5..] are the sorted sets
-- the entries go in. Each letter in ARGV is its id, its number of entries, then for each entry
-- the index in KEYS of its sorted set, its member, its payload and its window's name ('' if
-- none). Returns how many letters moved.
local moved = 0
local i = 1
while i <= #ARGV do
  local letter = ARGV[i]
  local n = tonumber(ARGV[i + 1])
  i = i + 2
  if redis.call('HDEL', KEYS[1], letter) == 1 then
    redis.call('ZREM', KEYS[2], letter)
    for e = 0, n - 1 do
      local at = i + 4 * e
      -- NX: a job still queued under the same id keeps its place and payload.
      redis.call('HSETNX', KEYS[3], ARGV[at + 1], ARGV[at + 2])
      redis.call('ZADD', KEYS[tonumber(ARGV[at])], 'NX', 0, ARGV[at + 1])
      if ARGV[at + 3] ~= '' then
        redis.call('SADD', KEYS[4], ARGV[at + 3])
      end
    end
    moved = moved + 1
  end
  i = i + 4 * n
end
return moved
