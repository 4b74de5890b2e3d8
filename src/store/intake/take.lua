-- Takes a batch of events of one database (see `src/engine/intake.rs` for what is taken how, and
-- `docs/how-it-works.md#what-keywatch-keeps-in-redis` for the keys). Run after the prelude
-- `store/handled/recalled.lua`.
--
-- KEYS: the ledger, its poked set, the poked deadlines, the intake's sorted set, its records,
-- the field ledger. ARGV: now, the latest deadline taken as due, the handled memory's minutes,
-- the lease's end, this instance, then as below.
local now = tonumber(ARGV[1])
local due_limit = tonumber(ARGV[2])
local minutes = tonumber(ARGV[3])
local lease_end = ARGV[4]
local me = ARGV[5]
-- The names of the handled memory (without its minute), of a claim without a deadline and of
-- the claims' hashes (without their minute and digit), given by the store (`store/intake.rs`).
local memory = ARGV[6]
local claim_prefix = ARGV[7]
local claims_prefix = ARGV[8]
local db = ARGV[9]
local batch = ARGV[10]
-- The events' records, a line each in the order of the events: stored as they are, with a line
-- naming those won, so the script neither copies nor joins them one by one.
local blob = ARGV[11]
-- One letter per event, its mode. An expiry (`L`, `l`, `R`, `r`) has one argument, its key;
-- any other event four: its kind, key, given deadline and extra (a claim key, a field).
local modes = ARGV[12]
local first = 13
local n = #modes
local minute = math.floor(now / 60000)
local B_L, B_l, B_R, B_r, B_F, B_f, B_W = string.byte('LlRrFfW', 1, 7)
-- Calls f with the elements of list from i to j, at most step at a time (Lua's stack bounds
-- unpack).
local function chunked(list, i, j, step, f)
  for k = i, j, step do
    f(unpack(list, k, math.min(k + step - 1, j)))
  end
end
-- Where each event's arguments start (with live expiries only, in a storm, event i's key is
-- ARGV[first + i - 1]), and the keys of the live expiries.
local live_only = not string.find(modes, '[^Ll]')
local at = {}
local live = {}
if not live_only then
  local a = first
  for i = 1, n do
    at[i] = a
    local m = string.byte(modes, i)
    if m == B_L or m == B_l or m == B_R or m == B_r then
      if m == B_L or m == B_l then live[#live + 1] = ARGV[a] end
      a = a + 1
    else
      a = a + 4
    end
  end
end
-- The ledger's scores of every live expiry, read in one command (a command per thousand), in
-- the order of the live expiries.
local scores = {}
local function read_scores(...)
  local got = redis.call('ZMSCORE', KEYS[1], ...)
  for j = 1, select('#', ...) do scores[#scores + 1] = got[j] end
end
if live_only then
  chunked(ARGV, first, first + n - 1, 1000, read_scores)
else
  chunked(live, 1, #live, 1000, read_scores)
end
-- The poked set's deadlines of every key that may be taken from it (a live expiry the ledger
-- has no due deadline for, a recovery), read in one command too.
local maybe_poked = {}
-- The due deadline of each live expiry that has one (by its place among them).
local due = {}
local li = 0
for i = 1, n do
  local m = string.byte(modes, i)
  if m == B_L or m == B_l then
    li = li + 1
    local s = scores[li]
    if s and tonumber(s) <= due_limit then
      due[li] = s
    else
      maybe_poked[#maybe_poked + 1] = ARGV[at[i] or first + i - 1]
    end
  elseif m == B_R or m == B_r then
    maybe_poked[#maybe_poked + 1] = ARGV[at[i]]
  end
end
local poked = {}
chunked(maybe_poked, 1, #maybe_poked, 1000, function(...)
  local got = redis.call('HMGET', KEYS[3], ...)
  for j = 1, select('#', ...) do
    if got[j] then poked[select(j, ...)] = got[j] end
  end
end)
-- Takes key's deadline out of the poked set (the removal written once for the batch).
local unpoked = {}
local function take_poked(key)
  local p = poked[key]
  if p then
    poked[key] = nil
    unpoked[#unpoked + 1] = key
  end
  return p
end
-- Writes of the hot path, sent once for the whole batch: the deadlines taken out of the
-- ledger, the handled memory, the record of every event won.
local unledgered = {}
local handled = {}
-- What this script remembered as handled, per key: a later event of the same key in the batch
-- must find it as if it had been written already.
local here = {}
local function remember(key, d)
  handled[#handled + 1] = key
  handled[#handled + 1] = d
  here[key] = d
end
-- The events won, as `n:deadline` joined by commas: the record's first line and the answer.
local won_parts = {}
local function won(i, d)
  if #won_parts > 0 then won_parts[#won_parts + 1] = ',' end
  won_parts[#won_parts + 1] = i
  won_parts[#won_parts + 1] = ':'
  won_parts[#won_parts + 1] = d or ''
end
li = 0
for i = 1, n do
  local m = string.byte(modes, i)
  local p = at[i] or first + i - 1
  if m == B_L or m == B_l then
    li = li + 1
    local key = ARGV[p]
    local s = due[li]
    local d = false
    -- `here`: the same key earlier in the batch took its deadline already.
    if s and not here[key] then
      unledgered[#unledgered + 1] = key
      d = s
    else
      d = take_poked(key) or false
    end
    if d then
      -- `remember` and `won` written out: this is a storm's path, once per expiry, and a Lua
      -- call per event each was a measurable share of the script.
      local hn = #handled
      handled[hn + 1] = key
      handled[hn + 2] = d
      here[key] = d
      if m == B_L then
        local wn = #won_parts
        if wn > 0 then
          won_parts[wn + 1] = ','
          wn = wn + 1
        end
        won_parts[wn + 1] = i
        won_parts[wn + 2] = ':'
        won_parts[wn + 3] = d
      end
    else
      local h = here[key] or recalled(memory, minute, minutes, key)
      if not (h and string.sub(h, 1, 1) ~= '~') then
        -- Taken without a known deadline: a deadline of this key learnt late (a fill or
        -- another instance read it before the key went) must not come back as a miss.
        remember(key, '~' .. now)
        if m == B_L then
          -- Claimed by a key shared by every instance, named by the event.
          local id = redis.sha1hex(db .. '|expired||' .. key)
          if redis.call('SET', claim_prefix .. id, me, 'NX', 'PX', 5000) then
            won(i, false)
          end
        end
      end
    end
  elseif m == B_R or m == B_r then
    local key = ARGV[p]
    local d = take_poked(key)
    if d then
      remember(key, d)
      if m == B_R then won(i, d) end
    end
  else
    local kind, key, given, extra = ARGV[p], ARGV[p + 1], ARGV[p + 2], ARGV[p + 3]
    if m == B_F or m == B_f then
      local s = redis.call('ZSCORE', KEYS[6], key)
      if s and tonumber(s) <= due_limit then
        redis.call('ZREM', KEYS[6], key)
        redis.call('HDEL', extra, given)
        if m == B_F then won(i, s) end
      end
    elseif m == B_W then
      if redis.call('SET', extra, me, 'NX', 'PXAT', tonumber(given) + 60000) then
        won(i, given ~= '' and given or false)
      end
    else
      -- Claimed by a write shared by every instance, named by the event.
      local d = given ~= '' and given or false
      local id = redis.sha1hex(db .. '|' .. kind .. '|' .. (d or '') .. '|' .. key)
      local w = 0
      if d then
        local b = math.floor(tonumber(d) / 60000)
        local hk = claims_prefix .. b .. ':' .. string.sub(id, 1, 1)
        w = redis.call('HSETNX', hk, id, me)
        local until_ms = (math.max(b, minute) + 1) * 60000 + 600000
        if redis.call('PEXPIRETIME', hk) < until_ms then
          redis.call('PEXPIREAT', hk, until_ms)
        end
      elseif redis.call('SET', claim_prefix .. id, me, 'NX', 'PX', 5000) then
        w = 1
      end
      if w == 1 then won(i, d) end
    end
  end
end
if live_only and #unledgered == n then
  chunked(ARGV, first, first + n - 1, 1000, function(...)
    redis.call('ZREM', KEYS[1], ...)
  end)
else
  chunked(unledgered, 1, #unledgered, 1000, function(...)
    redis.call('ZREM', KEYS[1], ...)
  end)
end
chunked(unpoked, 1, #unpoked, 1000, function(...)
  redis.call('ZREM', KEYS[2], ...)
  redis.call('HDEL', KEYS[3], ...)
end)
if #handled > 0 then
  local hk = memory .. minute
  chunked(handled, 1, #handled, 1000, function(...)
    redis.call('HSET', hk, ...)
  end)
  redis.call('PEXPIREAT', hk, (minute + minutes + 1) * 60000)
end
-- One record for every event this instance won: leased, renewed, taken over and cleared as one.
local won_list = table.concat(won_parts)
if #won_parts > 0 then
  redis.call('HSET', KEYS[5], batch, 'C\n' .. won_list .. '\n' .. blob)
  redis.call('ZADD', KEYS[4], lease_end, batch)
end
return won_list
