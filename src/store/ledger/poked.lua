-- The poked set's entries up to a marker, for recovery (`Deadlines::poked`). KEYS: the poked set,
-- the poked deadlines. ARGV: the marker number, how many at most, the length past which a key is
-- long, the long keys' copies' prefix. Returns the key, deadline pairs, and the copy, deadline,
-- length triples of the keys longer than that: a long key is not returned whole, as in
-- `ledger/minute.lua` (docs/reliability.md#bounded-whatever-the-key).
local keys = redis.call('ZRANGE', KEYS[1], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, ARGV[2])
local long, copies = tonumber(ARGV[3]), ARGV[4]
local rows, refs = {}, {}
for j = 1, #keys, 1000 do
  local last = math.min(j + 999, #keys)
  local ds = redis.call('HMGET', KEYS[2], unpack(keys, j, last))
  for i = j, last do
    local d = math.floor(tonumber(ds[i - j + 1] or '0') or 0)
    local k = keys[i]
    if #k > long then
      refer(refs, copies, k, d)
    else
      rows[#rows + 1] = k
      rows[#rows + 1] = d
    end
  end
end
return { rows, refs }
