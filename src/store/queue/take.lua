-- Takes up to ARGV[2] jobs due at ARGV[1] by moving them to ARGV[3] (the end of the lease).
-- Returns when the queue's earliest job is due after that (its score as text, or false when the
-- queue is empty), then id, payload pairs: the id too, so that a job whose payload is missing or
-- unreadable can be set aside instead of being leased again every 15 s.
local ids = redis.call('ZRANGE', KEYS[1], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[2]))
for _, id in ipairs(ids) do
  redis.call('ZADD', KEYS[1], ARGV[3], id)
end
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local out = {first[2] or false}
if #ids == 0 then return out end
local payloads = redis.call('HMGET', KEYS[2], unpack(ids))
for i, id in ipairs(ids) do
  out[2 * i] = id
  out[2 * i + 1] = payloads[i]
end
return out
