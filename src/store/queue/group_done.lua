-- Removes finished jobs (ARGV[2..]) of the window KEYS[1] and their payloads (KEYS[2]); an
-- emptied window leaves the list of windows KEYS[3] (its name there is ARGV[1]); their takeovers
-- (KEYS[4]) are forgotten.
for i = 2, #ARGV do
  redis.call('ZREM', KEYS[1], ARGV[i])
  redis.call('HDEL', KEYS[2], ARGV[i])
  redis.call('HDEL', KEYS[4], ARGV[i])
end
if redis.call('ZCARD', KEYS[1]) == 0 then
  redis.call('SREM', KEYS[3], ARGV[1])
end
return 0
