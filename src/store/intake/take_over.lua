-- Takes up to ARGV[2] records due at ARGV[1] by moving them to ARGV[3] (the end of the lease);
-- returns id, record, lines triples: a record of the take that names only the events won (`S`)
-- comes with its events' lines, kept apart as the field `ID:b`; any other with an empty string.
-- A record without payload is dropped.
local ids = redis.call('ZRANGE', KEYS[1], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[2]))
local out = {}
for _, id in ipairs(ids) do
  local r = redis.call('HGET', KEYS[2], id)
  if r then
    redis.call('ZADD', KEYS[1], ARGV[3], id)
    out[#out + 1] = id
    out[#out + 1] = r
    local lines = ''
    if string.sub(r, 1, 2) == 'S\n' then
      lines = redis.call('HGET', KEYS[2], id .. ':b') or ''
    end
    out[#out + 1] = lines
  else
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id .. ':b')
  end
end
return out
