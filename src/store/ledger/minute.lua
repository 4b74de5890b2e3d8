-- A minute's deadlines, for the walks that read the ledger whole (the reconcile after a reconnect,
-- `upcoming`). KEYS[1]: the minutes (not read; it names the node on a cluster). ARGV: the buckets'
-- prefix, the minute, the length past which a key is long, the long keys' copies' prefix. Returns
-- the key, deadline pairs of the minute's seconds, and the copy, deadline, length triples of its
-- keys longer than that.
--
-- A long key is not returned whole, as in `ledger/due.lua`: a reply that long doubles the
-- connection's read buffer, which then keeps its size (docs/reliability.md#bounded-whatever-the-key).
-- It is copied (`refer`, `ledger/bucket.lua`), and the walk reads the copy a MiB at a time.
local pre, minute = ARGV[1], tonumber(ARGV[2])
local long, copies = tonumber(ARGV[3]), ARGV[4]
local rows, refs = {}, {}
for s = minute * 60, minute * 60 + 59 do
  for _, b in ipairs({ pre .. s, pre .. s .. ':long' }) do
    local got = redis.call('HGETALL', b)
    for x = 1, #got, 2 do
      local d = s * 1000 + tonumber(got[x + 1])
      if #got[x] > long then
        refer(refs, copies, got[x], d)
      else
        rows[#rows + 1] = got[x]
        rows[#rows + 1] = d
      end
    end
  end
end
return { rows, refs }
