-- Counts the jobs of the sorted sets KEYS: a member each, a bundle as the jobs it holds.
local n = 0
for _, k in ipairs(KEYS) do
  n = n + redis.call('ZCARD', k)
  for _, id in ipairs(redis.call('ZRANGE', k, 0, -1)) do
    local b = tonumber(string.match(id, '^#(%d+)#'))
    if b then n = n + b - 1 end
  end
end
return n
