-- `recalled(memory, minute, minutes, key)` is what the handled memory (`memory` is its name
-- without the minute) holds for `key` over the `minutes` before `minute`, or `false`. The
-- minutes' hashes that exist are listed once per script run: most are absent, and a miss then
-- costs one `HGET` per hash that exists.
local recent = nil
local function recalled(memory, minute, minutes, key)
  if not recent then
    recent = {}
    for m = minute, minute - minutes, -1 do
      if redis.call('EXISTS', memory .. m) == 1 then
        recent[#recent + 1] = memory .. m
      end
    end
  end
  for _, hk in ipairs(recent) do
    local h = redis.call('HGET', hk, key)
    if h then return h end
  end
  return false
end
