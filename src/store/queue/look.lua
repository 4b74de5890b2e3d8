-- What the take stage finds due, in one call (an idle instance sends this about once a second):
-- the earliest due time in the queue KEYS[1] (a job's due time, or its lease's end), the windows
-- listed in KEYS[2] (as JSON `[rule, channel]`; each a sorted set named ARGV[2] .. rule .. ':' ..
-- channel) with a member due by ARGV[1], the earliest due time of the others, and the targets
-- listed in KEYS[3] as having jobs waiting for them. Every window's key shares the state's hash
-- tag (docs/cluster.md), so on a cluster it lives on the node of the keys named here.
-- Returns {queue next or -1, windows next or -1, {windows due}, {targets waiting}}.
local now = tonumber(ARGV[1])
local q = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local qnext = -1
if #q > 0 then qnext = tonumber(q[2]) end
local due, wnext = {}, -1
for _, w in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local ok, rc = pcall(cjson.decode, w)
  if ok and type(rc) == 'table' and rc[1] and rc[2] then
    local first = redis.call('ZRANGE', ARGV[2] .. rc[1] .. ':' .. rc[2], 0, 0, 'WITHSCORES')
    if #first > 0 then
      local at = tonumber(first[2])
      if at <= now then
        due[#due + 1] = w
      elseif wnext < 0 or at < wnext then
        wnext = at
      end
    end
  end
end
return {qnext, wnext, due, redis.call('SMEMBERS', KEYS[3])}
