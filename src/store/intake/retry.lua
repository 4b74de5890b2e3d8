-- Puts record ARGV[1] back, due at ARGV[2] with its record now ARGV[3] (whole: the lines a take
-- kept apart, `ID:b`, go), if it is still there.
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
  redis.call('HDEL', KEYS[2], ARGV[1] .. ':b')
  return 1
end
return 0
