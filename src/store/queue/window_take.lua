-- Takes members of the window KEYS[1] due at ARGV[1], in score order (a window's members share
-- its end, so by member name among them: a digest orders its events itself), until the jobs they hold
-- (a bundle counts as the jobs it holds) reach ARGV[2], leased until ARGV[3]; returns member,
-- payload, takeovers triples (KEYS[2] holds the payloads; a member whose lease ran out, its
-- score a lease's end half a millisecond past a whole one, has its takeovers counted in KEYS[3]).
local max = tonumber(ARGV[2])
local seen = redis.call('ZRANGE', KEYS[1], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, max, 'WITHSCORES')
local ids, over = {}, {}
local jobs = 0
for i = 1, #seen, 2 do
  local id = seen[i]
  local n = tonumber(string.match(id, '^#(%d+)#')) or 1
  if jobs >= max then break end
  ids[#ids + 1] = id
  local score = tonumber(seen[i + 1])
  if score ~= math.floor(score) then
    over[#ids] = redis.call('HINCRBY', KEYS[3], id, 1)
  else
    over[#ids] = 0
  end
  jobs = jobs + n
end
local out = {}
for j = 1, #ids, 1000 do
  local last = math.min(j + 999, #ids)
  local leased = {}
  for i = j, last do
    leased[#leased + 1] = ARGV[3]
    leased[#leased + 1] = ids[i]
  end
  redis.call('ZADD', KEYS[1], unpack(leased))
  local payloads = redis.call('HMGET', KEYS[2], unpack(ids, j, last))
  for i = j, last do
    out[#out + 1] = ids[i]
    out[#out + 1] = payloads[i - j + 1]
    out[#out + 1] = tostring(over[i])
  end
end
return out
