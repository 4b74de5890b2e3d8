-- Records read deadlines (ARGV[1] is the slack, ARGV[2] the handled memory's name without its
-- minute, ARGV[3] the current minute, ARGV[4] how many minutes it goes back, then key/deadline
-- pairs): a positive deadline goes in unless the handled memory says this incarnation's expiry
-- was taken already, either with that very deadline (or a later one) or, as `~T`, without a
-- known deadline at T; a deadline at or before T (plus clock slack) belonged to the key that
-- expired then.
-- Run after the prelude `store/handled/recalled.lua`.
local slack = tonumber(ARGV[1])
local minute, minutes = tonumber(ARGV[3]), tonumber(ARGV[4])
for i = 5, #ARGV, 2 do
  local k, d = ARGV[i], tonumber(ARGV[i + 1])
  if d > 0 then
    local h = recalled(ARGV[2], minute, minutes, k)
    local stale = false
    if h then
      if string.sub(h, 1, 1) == '~' then
        stale = d <= tonumber(string.sub(h, 2)) + slack
      else
        stale = d <= tonumber(h)
      end
    end
    if not stale then
      redis.call('ZADD', KEYS[1], d, k)
    end
  else
    redis.call('ZREM', KEYS[1], k)
  end
end
return 0
