-- Takes members of the window KEYS[1] due at ARGV[1], in score order (a window's members share
-- its end, so by member name among them: a digest orders its events itself), until the jobs they hold
-- (a bundle counts as the jobs it holds) reach ARGV[2], leased until ARGV[3]; returns member,
-- payload pairs (KEYS[2] holds the payloads).
local max = tonumber(ARGV[2])
local seen = redis.call('ZRANGE', KEYS[1], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, max)
local ids = {}
local jobs = 0
for _, id in ipairs(seen) do
  local n = tonumber(string.match(id, '^#(%d+)#')) or 1
  if jobs >= max then break end
  ids[#ids + 1] = id
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
  end
end
return out
