-- Moves member ARGV[1] of KEYS[1] to the score ARGV[3] only while its score is ARGV[2]: a lease
-- is renewed only by whoever holds it, and a group is made due at once only while nobody is
-- releasing it. Returns 1 when it moved.
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) == tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], 'XX', ARGV[3], ARGV[1])
  return 1
end
return 0
