-- Puts jobs (ARGV[4..] as id, payload pairs) into the window of KEYS[1] (its end) and KEYS[2]
-- (its jobs), opening a window of ARGV[2] ms at ARGV[1] if none is open; KEYS[3] is the payload
-- hash, KEYS[4] the list of windows and ARGV[3] this window's name in it. Returns the end.
local e = redis.call('GET', KEYS[1])
if not e then
  e = tonumber(ARGV[1]) + tonumber(ARGV[2])
  -- Gone exactly at the end its jobs are due at (`PXAT`): a relative `PX` counted from this
  -- script's own clock, and a notification put in between joined a window already taken and
  -- went out alone.
  redis.call('SET', KEYS[1], e, 'PXAT', e)
end
for i = 4, #ARGV, 2 do
  redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
  redis.call('ZADD', KEYS[2], 'NX', e, ARGV[i])
end
redis.call('SADD', KEYS[4], ARGV[3])
return tonumber(e)
