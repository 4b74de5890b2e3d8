-- The ledger's compact form (docs/how-it-works.md#the-ledgers-compact-form): a key's deadline
-- lives in the hash of the second it falls in, `PRE .. SECOND` (field: the key, value: the
-- milliseconds within that second), or `PRE .. SECOND .. ':long'` for a key longer than
-- `LONG_KEY` bytes, which would turn a whole second's hash from Redis's compact listpack into
-- a hashtable. Every instance derives the same name from a key and its deadline alone, so a
-- hash's field is the one place the deadline can be, and removing it (`HDEL`) answers one
-- caller only.
local LONG_KEY = 64
local function long_key(key)
  return #key > LONG_KEY
end
local function bucket(pre, second, key)
  if long_key(key) then
    return pre .. second .. ':long'
  end
  return pre .. second
end
-- Calls f with the elements of list from i to j, at most step at a time (Lua's stack bounds
-- unpack).
local function chunked(list, i, j, step, f)
  for k = i, j, step do
    f(unpack(list, k, math.min(k + step - 1, j)))
  end
end
-- Appends v to the list of name in groups, noting name in order the first time: writes grouped
-- by hash, in the order the hashes were first met.
local function group_add(groups, order, name, v)
  local g = groups[name]
  if not g then
    g = {}
    groups[name] = g
    order[#order + 1] = name
  end
  g[#g + 1] = v
end
-- A key longer than a reply should carry (docs/reliability.md#bounded-whatever-the-key), copied
-- to a string of its own for a minute, named by its SHA-1 under `copies` (a copy of it is never
-- written twice), for the caller to read a MiB at a time: appends the copy's name, `d` and the
-- key's length to `refs`.
local function refer(refs, copies, key, d)
  local copy = copies .. redis.sha1hex(key)
  redis.call('SET', copy, key, 'NX', 'PX', 60000)
  refs[#refs + 1] = copy
  refs[#refs + 1] = d
  refs[#refs + 1] = #key
end
