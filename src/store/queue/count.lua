-- Counts the jobs of the sorted sets KEYS: a member each, a bundle as the jobs it holds. Returns
-- that and how many of them are due and not taken: those of the queue KEYS[1] due by ARGV[1] (a
-- taken job's score is the end of its lease; a later round's or a retry's, when it is due) and
-- every job of the targets' waiting sets, KEYS[2] to KEYS[1 + ARGV[2]] (taken when due, set
-- aside until their target has free places). The digest windows after them wait for their window.
local now = tonumber(ARGV[1])
local waiting = tonumber(ARGV[2])
local n, due = 0, 0
for i, k in ipairs(KEYS) do
  local members = redis.call('ZRANGE', k, 0, -1, 'WITHSCORES')
  for j = 1, #members, 2 do
    local size = tonumber(string.match(members[j], '^#(%d+)#')) or 1
    n = n + size
    if (i == 1 and tonumber(members[j + 1]) <= now) or (i > 1 and i <= 1 + waiting) then
      due = due + size
    end
  end
end
return {n, due}
