-- Moves job ARGV[3] (payload ARGV[4]) out of its bundle ARGV[1], where it is job ARGV[2], into
-- the sorted set KEYS[3] at ARGV[5] (a retry, or a wait for its target; KEYS[6], when given,
-- lists that target as ARGV[6]), its takeovers (KEYS[5]) forgotten, and marks it done in the
-- bundle (KEYS[4]): only while the
-- bundle is still in the queue KEYS[1] (with KEYS[2] the payloads), as `RESCHEDULE` and `PARK`
-- move only jobs still there. Returns 1 when it moved.
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
redis.call('ZADD', KEYS[3], ARGV[5], ARGV[3])
redis.call('HSET', KEYS[4], ARGV[2], '1')
redis.call('HDEL', KEYS[5], ARGV[3])
if KEYS[6] then redis.call('SADD', KEYS[6], ARGV[6]) end
return 1
