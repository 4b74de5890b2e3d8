-- The poker's read of due deadlines (run after `ledger/bucket.lua`). KEYS[1]: the minutes.
-- ARGV: the buckets' prefix, now, how many due entries to skip, how many to return. Returns
-- the key, deadline pairs due by now, and the earliest score left in the minutes (-1: none),
-- which is when the poker looks next unless it learns of an earlier deadline meanwhile
-- (docs/how-it-works.md#the-poker).
--
-- Each minute that holds deadlines has a score no later than the earliest of them, so a minute
-- whose score is in the future holds nothing due and is not read. A minute read whole gets its
-- score raised to the earliest deadline it still holds and leaves once it holds nothing: the
-- poker sleeps until that score. For the seconds of a minute still to come, the first one that
-- holds a deadline holds the minute's earliest, so they are looked at in order (`EXISTS`)
-- until one does.
local pre, now = ARGV[1], tonumber(ARGV[2])
local skip, limit = tonumber(ARGV[3]), tonumber(ARGV[4])
local out = {}
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
return { out, first[2] and tonumber(first[2]) or -1 }
