-- Sets jobs that cannot be read aside (ARGV as id, payload pairs): out of the sorted set
-- KEYS[1] and the payload hash KEYS[2], the payload (when there is one) kept in KEYS[3], and
-- their takeovers (KEYS[4]) forgotten.
for i = 1, #ARGV, 2 do
  if ARGV[i + 1] ~= '' then
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
  end
  redis.call('ZREM', KEYS[1], ARGV[i])
  redis.call('HDEL', KEYS[2], ARGV[i])
  redis.call('HDEL', KEYS[4], ARGV[i])
end
return 0
