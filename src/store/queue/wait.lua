-- Moves jobs (ARGV[3..]) still in the queue KEYS[1] to the waiting set KEYS[2] of their target,
-- at ARGV[2] (oldest first), and lists that set (ARGV[1]) in KEYS[3]; their takeovers (KEYS[4])
-- start again. Returns how many moved.
local n = 0
for i = 3, #ARGV do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    redis.call('ZADD', KEYS[2], ARGV[2], ARGV[i])
    redis.call('HDEL', KEYS[4], ARGV[i])
    n = n + 1
  end
end
if n > 0 then
  redis.call('SADD', KEYS[3], ARGV[1])
end
return n
