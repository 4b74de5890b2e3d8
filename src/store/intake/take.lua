-- Takes a batch of events of one database (see `src/engine/intake.rs` for what is taken how, and
-- `docs/how-it-works.md#what-keywatch-keeps-in-redis` for the keys). Run after the preludes
-- `store/handled/recalled.lua` and `store/ledger/bucket.lua`.
--
-- KEYS: the ledger's minutes, its poked set, the poked deadlines, the intake's sorted set, its
-- records, the field ledger's minutes. ARGV: now, the latest deadline taken as due, the handled memory's
-- minutes, the lease's end, this instance, then as below.
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
-- naming those won, so the script neither copies nor joins them one by one. Empty: a batch's
-- lines too long to pass through Lua, which hashes every byte of every string it makes (the
-- argument, and the record joined from it: about a sixth of the script in a storm); the store
-- wrote them beforehand, in the same transaction, as the field `batch:b` of the records
-- (`store/intake.rs`), and the record names only the events won (`S`).
local blob = ARGV[11]
local apart = blob == ''
local function drop_apart()
  if apart then redis.call('HDEL', KEYS[5], ARGV[10] .. ':b') end
end
-- One letter per event, its mode. A live expiry (`L`, `l`) has two arguments, its key and the
-- second its deadline falls in as the instance's index knows it (empty: not known), or three
-- (`M`, `m`) with its place in the node's stream (`MARK:N`, see `src/source/places.rs`); a
-- recovery (`R`, `r`) one, its key; any other event four: its kind, key, given deadline and
-- extra (a claim key, a field, or for an event without a deadline its place, maybe empty).
local modes = ARGV[12]
-- The ledger's hashes (without their second), how far back a live expiry of a key the index
-- did not know is looked for, and how old a deadline taken by a live expiry must be for the take
-- to ask the handled memory whether it was taken without one (see below), and the clock slack.
local pre = ARGV[13]
local window = tonumber(ARGV[14])
local late = tonumber(ARGV[15])
local slack = tonumber(ARGV[16])
-- The field ledger's hashes (without their second), and from them the start of the index of a
-- hash with a long name and of where that name is kept (`store/fields.rs`).
local field_pre = ARGV[17]
local field_base = string.sub(field_pre, 1, #field_pre - 4)
local long_index = field_base .. ':hl:'
-- The places (comma separated) of the arguments below that name where a long key is kept
-- (`store/long_keys.rs`) instead of carrying it: read here, so that a key of megabytes crosses
-- to Redis once, in chunks, not again in this script's arguments
-- (docs/reliability.md#bounded-whatever-the-key).
for p in string.gmatch(ARGV[18], '%d+') do
  local i = tonumber(p)
  local exact = redis.call('GET', ARGV[i])
  if not exact then
    drop_apart()
    return redis.error_reply('KEYWATCH long key gone: ' .. ARGV[i])
  end
  ARGV[i] = exact
end
local first = 19
local n = #modes
local minute = math.floor(now / 60000)
local B_L, B_l, B_R, B_r, B_F, B_f, B_W, B_M, B_m = string.byte('LlRrFfWMm', 1, 9)
-- Where each event's arguments start, and the live expiries: their key, second and place.
-- Lists are appended to by a count kept beside them (here and below, on the storm's path): `#`
-- is a search each time.
local at = {}
local live, live_second, live_place = {}, {}, {}
do
  local a = first
  local nl = 0
  for i = 1, n do
    at[i] = a
    local m = string.byte(modes, i)
    if m == B_L or m == B_l then
      nl = nl + 1
      live[nl] = ARGV[a]
      live_second[nl] = ARGV[a + 1]
      a = a + 2
    elseif m == B_M or m == B_m then
      nl = nl + 1
      live[nl] = ARGV[a]
      live_second[nl] = ARGV[a + 1]
      live_place[nl] = ARGV[a + 2]
      a = a + 3
    elseif m == B_R or m == B_r then
      a = a + 1
    else
      a = a + 4
    end
  end
end
-- Whether the handled memory says the expiry of `key` due at `d` was taken already: as `~T`,
-- without a known deadline, at or after it (plus clock slack), or with that deadline or a later
-- one.
local function handled_before(key, d)
  local h = recalled(memory, minute, minutes, key)
  if not h then return false end
  if string.sub(h, 1, 1) == '~' then return d <= tonumber(string.sub(h, 2)) + slack end
  return d <= tonumber(h)
end
-- The due deadline of each live expiry whose hash holds it (by its place among them), as the
-- text Redis would write for the number (the handled memory's value and the answer's), and the
-- hash it is removed from. Read with one HMGET per hash and thousand keys: in a storm the keys
-- of a batch share a second.
local due, due_in = {}, {}
-- Live expiries whose deadline may be older than `late` (see below): only those are compared.
local maybe_late = {}
-- The deadline `off` ms into second s (both as written: digits), as text. Joined rather than
-- computed: a number turned into text is a `%.14g` `sprintf`, three per event were a tenth of
-- the script in a storm. An offset is 0 to 999 as every writer writes it; anything else (and
-- a second before 1970, a sign) is computed.
local function deadline_text(s, off)
  local n = #off
  if string.byte(s, 1) ~= 45 and string.byte(off, 1) ~= 45 then
    if n == 3 then return s .. off end
    if n == 2 then return s .. '0' .. off end
    if n == 1 then return s .. '00' .. off end
  end
  return tostring(tonumber(s) * 1000 + tonumber(off))
end
-- Notes live expiry li's deadline, `off` ms into second s of hash b, if it is due. `all_due`:
-- the whole second is, so the deadline need not be computed to be compared; `recent`: the
-- whole second is later than `late` ago.
local function found(li, b, s, off, all_due, recent)
  if not all_due and tonumber(s) * 1000 + tonumber(off) > due_limit then return false end
  due[li] = deadline_text(s, off)
  due_in[li] = b
  if not recent then maybe_late[li] = true end
  return true
end
do
  local groups, order = {}, {}
  -- The hash's name, made once per second rather than once per event.
  local last_s, last_b = nil, nil
  for li = 1, #live do
    local s = live_second[li]
    if s ~= '' then
      local key = live[li]
      local b
      if long_key(key) then
        b = bucket(pre, s, key)
      else
        if s ~= last_s then
          last_s, last_b = s, pre .. s
        end
        b = last_b
      end
      group_add(groups, order, b, li)
    end
  end
  for _, b in ipairs(order) do
    local g = groups[b]
    -- A hash's keys share their second: due whole, or compared one by one.
    local s = live_second[g[1]]
    local sn = tonumber(s)
    local all_due = (sn + 1) * 1000 - 1 <= due_limit
    local recent = sn * 1000 >= now - late
    for j = 1, #g, 1000 do
      local last = math.min(j + 999, #g)
      local keys = {}
      for x = j, last do keys[x - j + 1] = live[g[x]] end
      local got = redis.call('HMGET', b, unpack(keys))
      for x = j, last do
        local off = got[x - j + 1]
        if off then found(g[x], b, s, off, all_due, recent) end
      end
    end
  end
end
-- The poked set's deadlines of every key that may be taken from it (a live expiry the ledger
-- has no due deadline for, a recovery), read in one command too.
local maybe_poked = {}
for li = 1, #live do
  if not due[li] then maybe_poked[#maybe_poked + 1] = live[li] end
end
for i = 1, n do
  local m = string.byte(modes, i)
  if m == B_R or m == B_r then maybe_poked[#maybe_poked + 1] = ARGV[at[i]] end
end
local poked = {}
chunked(maybe_poked, 1, #maybe_poked, 1000, function(...)
  local got = redis.call('HMGET', KEYS[3], ...)
  for j = 1, select('#', ...) do
    if got[j] then poked[select(j, ...)] = got[j] end
  end
end)
-- A live expiry found neither where the index said nor in the poked set is looked for in the
-- hashes of the last `window` ms, where every instance looks: an instance that just started
-- (its index not rebuilt yet), or whose index missed a deadline another instance recorded,
-- then claims the same hash field as the instance that knew it, and only one of them wins.
-- The hashes that exist are listed once, and only when some expiry needs them.
local recent_hashes = nil
for li = 1, #live do
  local key = live[li]
  if not due[li] and not poked[key] then
    if not recent_hashes then
      recent_hashes = {}
      for s = math.floor(due_limit / 1000), math.floor((now - window) / 1000), -1 do
        if redis.call('EXISTS', pre .. s) == 1 then
          recent_hashes[#recent_hashes + 1] = { pre .. s, s, false }
        end
        if redis.call('EXISTS', pre .. s .. ':long') == 1 then
          recent_hashes[#recent_hashes + 1] = { pre .. s .. ':long', s, true }
        end
      end
    end
    local long = long_key(key)
    for _, bs in ipairs(recent_hashes) do
      local b, s, of_long = bs[1], bs[2], bs[3]
      if of_long == long then
        local off = redis.call('HGET', b, key)
        if off and found(li, b, tostring(s), off, false, false) then break end
      end
    end
  end
end
-- The claim of an event without a deadline. With its place in the node's stream (`MARK:N`),
-- a field of the mark's hash that lasts ten minutes after its last claim, so that an instance
-- reading the event minutes late still finds it taken, and the key deleted again is another
-- field; without one (a subscriber that has heard no mark yet), a key of its own named by the
-- event, for 5 s: a copy read later than that is taken again, a repeat within it is lost.
-- A placed claim writes that key as well (`@` and the instance), for instances of a version
-- before places (an upgrade), and yields to one such an instance wrote.
local placed, placed_order = {}, {}
local function claim(kind, key, place)
  local by_name = claim_prefix .. redis.sha1hex(db .. '|' .. kind .. '||' .. key)
  local mark, nth = string.match(place or '', '^(%x+):(%d+)$')
  if not mark then
    return redis.call('SET', by_name, me, 'NX', 'PX', 5000) and true or false
  end
  local other = redis.call('GET', by_name)
  if other and string.sub(other, 1, 1) ~= '@' then return false end
  local hk = claims_prefix .. 'at:' .. mark
  if not placed[hk] then
    placed[hk] = true
    placed_order[#placed_order + 1] = hk
  end
  local id = redis.sha1hex(db .. '|' .. kind .. '|' .. nth .. '|' .. key)
  if redis.call('HSETNX', hk, id, me) == 0 then return false end
  redis.call('SET', by_name, '@' .. me, 'PX', 5000)
  return true
end
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
-- ledger (by hash), the handled memory, the record of every event won.
local unledgered, unledgered_order = {}, {}
local unledgered_last, unledgered_list, unledgered_n = nil, nil, 0
local handled, nh = {}, 0
-- What this script remembered as handled, per key: a later event of the same key in the batch
-- must find it as if it had been written already.
local here = {}
local function remember(key, d)
  handled[nh + 1] = key
  handled[nh + 2] = d
  nh = nh + 2
  here[key] = d
end
-- The events won, as `n:deadline` joined by commas: the record's first line and the answer.
-- Each written by `string.format`'s `%d`: a number turned into text otherwise is a `%.14g`.
local won_parts, nw = {}, 0
local function won(i, d)
  nw = nw + 1
  won_parts[nw] = string.format('%d:%s', i, d or '')
end
local format = string.format
local li = 0
for i = 1, n do
  local m = string.byte(modes, i)
  local p = at[i]
  if m == B_L or m == B_l or m == B_M or m == B_m then
    li = li + 1
    local key = ARGV[p]
    local s = due[li]
    local d = false
    -- Taken before by an instance that did not know the deadline (see below): removed, not won.
    local taken = false
    -- `here`: the same key earlier in the batch took its deadline already.
    if s and not here[key] then
      -- `group_add` written out, the last hash's list at hand: in a storm they share one.
      local b = due_in[li]
      if b ~= unledgered_last then
        unledgered_last = b
        unledgered_list = unledgered[b]
        if not unledgered_list then
          unledgered_list = {}
          unledgered[b] = unledgered_list
          unledgered_order[#unledgered_order + 1] = b
        end
        unledgered_n = #unledgered_list
      end
      unledgered_n = unledgered_n + 1
      unledgered_list[unledgered_n] = key
      -- An instance whose index missed the key looks for it only `window` ms back: past that
      -- it claimed the expiry without a deadline (`~T`), which only the handled memory shows.
      -- Not asked on time: the storm's path.
      if maybe_late[li] and tonumber(s) < now - late and handled_before(key, tonumber(s)) then
        taken = true
      else
        d = s
      end
    else
      d = take_poked(key) or false
      -- The poked set is past the window as well.
      if d and handled_before(key, tonumber(d)) then
        d = false
        taken = true
      end
    end
    if d then
      -- `remember` and `won` written out: this is a storm's path, once per expiry, and a Lua
      -- call per event each was a measurable share of the script.
      handled[nh + 1] = key
      handled[nh + 2] = d
      nh = nh + 2
      here[key] = d
      if m == B_L or m == B_M then
        nw = nw + 1
        won_parts[nw] = format('%d:%s', i, d)
      end
    elseif not taken then
      local h = here[key] or recalled(memory, minute, minutes, key)
      if not (h and string.sub(h, 1, 1) ~= '~') then
        -- Taken without a known deadline: a deadline of this key learnt late (a fill or
        -- another instance read it before the key went) must not come back as a miss.
        remember(key, '~' .. now)
        if (m == B_L or m == B_M) and claim('expired', key, live_place[li]) then
          won(i, false)
        end
      end
    end
  elseif m == B_R or m == B_r then
    local key = ARGV[p]
    local d = take_poked(key)
    if d and not handled_before(key, tonumber(d)) then
      remember(key, d)
      if m == B_R then won(i, d) end
    end
  else
    local kind, key, given, extra = ARGV[p], ARGV[p + 1], ARGV[p + 2], ARGV[p + 3]
    if m == B_F or m == B_f then
      -- The field's deadline is in its hash's index (`extra`); removing it there is the claim,
      -- and the member leaves its second's hash with it.
      local s = redis.call('HGET', extra, given)
      if s and tonumber(s) <= due_limit then
        redis.call('HDEL', extra, given)
        redis.call('HDEL', bucket(field_pre, math.floor(tonumber(s) / 1000), key), key)
        -- A long hash's name leaves with its last field (`store/fields/write.lua`).
        if string.sub(extra, 1, #long_index) == long_index and redis.call('HLEN', extra) == 0 then
          redis.call('DEL', field_base .. ':name:' .. string.sub(extra, #long_index + 1))
        end
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
      elseif claim(kind, key, extra) then
        w = 1
      end
      if w == 1 then won(i, d) end
    end
  end
end
for _, b in ipairs(unledgered_order) do
  local g = unledgered[b]
  chunked(g, 1, #g, 1000, function(...)
    redis.call('HDEL', b, ...)
  end)
end
for _, hk in ipairs(placed_order) do
  redis.call('PEXPIRE', hk, 600000)
end
chunked(unpoked, 1, #unpoked, 1000, function(...)
  redis.call('ZREM', KEYS[2], ...)
  redis.call('HDEL', KEYS[3], ...)
end)
if nh > 0 then
  local hk = memory .. minute
  chunked(handled, 1, nh, 1000, function(...)
    redis.call('HSET', hk, ...)
  end)
  redis.call('PEXPIREAT', hk, (minute + minutes + 1) * 60000)
end
-- One record for every event this instance won: leased, renewed, taken over and cleared as one.
local won_list = table.concat(won_parts, ',')
if nw > 0 then
  if apart then
    redis.call('HSET', KEYS[5], batch, 'S\n' .. won_list)
  else
    redis.call('HSET', KEYS[5], batch, 'C\n' .. won_list .. '\n' .. blob)
  end
  redis.call('ZADD', KEYS[4], lease_end, batch)
else
  drop_apart()
end
return won_list
