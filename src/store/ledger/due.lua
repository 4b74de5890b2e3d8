-- The poker's read of due deadlines (run after `ledger/bucket.lua`). KEYS[1]: the minutes.
-- ARGV: the buckets' prefix, now, how many due entries to skip, how many to return, the length
-- past which a key is long, the long keys' copies' prefix. Returns the key, deadline pairs due
-- by now, the earliest score left in the minutes (-1: none), which is when the poker looks next
-- unless it learns of an earlier deadline meanwhile (docs/how-it-works.md#the-poker), and the
-- copy, deadline, length triples of the due keys longer than that.
--
-- A long key (megabytes: docs/reliability.md#bounded-whatever-the-key) is not returned whole:
-- a reply that long doubles the connection's read buffer, which then keeps its size. It is
-- copied to a string of its own (for a minute; named by its SHA-1, so a copy of it is never
-- written twice), which the poker reads a MiB at a time.
--
-- Each minute that holds deadlines has a score no later than the earliest of them, so a minute
-- whose score is in the future holds nothing due and is not read. A minute read whole gets its
-- score raised to the earliest deadline it still holds and leaves once it holds nothing: the
-- poker sleeps until that score. For the seconds of a minute still to come, the first one that
-- holds a deadline holds the minute's earliest, so they are looked at in order (`EXISTS`)
-- until one does.
local pre, now = ARGV[1], tonumber(ARGV[2])
local skip, limit = tonumber(ARGV[3]), tonumber(ARGV[4])
local long, copies = tonumber(ARGV[5]), ARGV[6]
local out = {}
local refs = {}
local full = false
local minutes = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, 64, 'WITHSCORES')
for j = 1, #minutes, 2 do
  local m, low = tonumber(minutes[j]), tonumber(minutes[j + 1])
  local last = math.min(math.floor(now / 1000), m * 60 + 59)
  local whole = true
  local least = nil
  for s = math.max(math.floor(low / 1000), m * 60), last do
    for _, b in ipairs({ pre .. s, pre .. s .. ':long' }) do
      -- A second's hash is read in pages: in a mass expiry it holds the whole storm.
      local cursor = '0'
      repeat
        local page = redis.call('HSCAN', b, cursor, 'COUNT', 1000)
        cursor = page[1]
        local got = page[2]
        for x = 1, #got, 2 do
          local d = s * 1000 + tonumber(got[x + 1])
          if not least or d < least then least = d end
          if d <= now then
            if skip > 0 then
              skip = skip - 1
            elseif #got[x] > long then
              refer(refs, copies, got[x], d)
              out[#out + 1] = false
              out[#out + 1] = false
            else
              out[#out + 1] = got[x]
              out[#out + 1] = d
            end
          end
        end
        full = #out >= 2 * limit
      until cursor == '0' or full
      if cursor ~= '0' then whole = false end
      if full then break end
    end
    if full then break end
  end
  if whole and not full then
    local bound = least
    if last < m * 60 + 59 and (not bound or bound > (last + 1) * 1000) then
      for s = last + 1, m * 60 + 59 do
        if redis.call('EXISTS', pre .. s, pre .. s .. ':long') > 0 then
          for _, b in ipairs({ pre .. s, pre .. s .. ':long' }) do
            local cursor = '0'
            repeat
              local page = redis.call('HSCAN', b, cursor, 'COUNT', 1000)
              cursor = page[1]
              local got = page[2]
              for x = 2, #got, 2 do
                local d = s * 1000 + tonumber(got[x])
                if not bound or d < bound then bound = d end
              end
            until cursor == '0'
          end
          break
        end
      end
    end
    if bound then
      redis.call('ZADD', KEYS[1], 'XX', bound, m)
    else
      redis.call('ZREM', KEYS[1], m)
    end
  end
  if full then break end
end
local first = redis.call('ZRANGE', KEYS[1], '-inf', '+inf', 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
-- The long keys' places counted against the limit, but not returned.
local rows = {}
for i = 1, #out, 2 do
  if out[i] then
    rows[#rows + 1] = out[i]
    rows[#rows + 1] = out[i + 1]
  end
end
return { rows, first[2] and tonumber(first[2]) or -1, refs }
