-- Takes up to ARGV[2] jobs due at ARGV[1] by moving them to ARGV[3] (the end of the lease; a
-- lease's end is half a millisecond past a whole one, a due time a whole one). A job whose
-- lease ran out (its taker died, or stalled) has its takeovers counted in KEYS[3].
-- Returns when the queue's earliest job is due after that (its score as text, or false when the
-- queue is empty), then id, payload, takeovers triples: the id too, so that a job whose payload
-- is missing or unreadable can be set aside instead of being leased again every 15 s.
local taken = redis.call('ZRANGE', KEYS[1], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[2]), 'WITHSCORES')
local ids, over = {}, {}
for i = 1, #taken, 2 do
  local id = taken[i]
  ids[#ids + 1] = id
  local score = tonumber(taken[i + 1])
  if score ~= math.floor(score) then
    over[#ids] = redis.call('HINCRBY', KEYS[3], id, 1)
  else
    over[#ids] = 0
  end
  redis.call('ZADD', KEYS[1], ARGV[3], id)
end
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local out = {first[2] or false}
if #ids == 0 then return out end
local payloads = redis.call('HMGET', KEYS[2], unpack(ids))
for i, id in ipairs(ids) do
  out[3 * i - 1] = id
  out[3 * i] = payloads[i]
  out[3 * i + 1] = tostring(over[i])
end
return out
