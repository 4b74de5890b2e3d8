-- Moves jobs (ARGV[2..] as id, payload pairs) of the sorted set KEYS[1] to ARGV[1] ms, with
-- their new payloads in KEYS[2], but only those still in KEYS[1]: a job another instance took
-- over when this one lost its lease, and finished, must not come back. Its takeovers (KEYS[3])
-- start again: its outcome is recorded. Returns how many moved.
local n = 0
for i = 2, #ARGV, 2 do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
    redis.call('ZADD', KEYS[1], 'XX', ARGV[1], ARGV[i])
    redis.call('HDEL', KEYS[3], ARGV[i])
    n = n + 1
  end
end
return n
