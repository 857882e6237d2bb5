-- KEYS: adm, own, queue (global waiting ZSET, lowest score first), tomb, asked (the
--   session's mark: its replica asked for it lately; the prefix before the session names the
--   marks of the others, in the pool's hash tag, so its slot)
--   KEYS[6..]: the lease ZSETs of the pool's other workers (none: not checked)
-- ARGV: session, free_slots, limit, now_ms, expiry_ms, replica, score ('' = do not enqueue)
-- Admits a waiting session only while it is among the first free_slots of the global queue and
-- the worker has room, and takes it out of the queue in the same step: order holds across
-- replicas. With a score, a session not yet waiting joins the queue first, and one waiting
-- takes the new score (the policy's order moves as tenants are served): one round trip for
-- both. Returns 1 admitted (or already admitted), 0 not yet, or the lease key of another
-- worker where the session holds a live lease: another replica admitted it first (its first
-- requests reached two replicas at once). It takes no second lease and leaves the queue; its
-- replica claims that lease instead.
-- Every ask marks the session as asked for one lease TTL (its replica asks every control
-- tick). An entry ahead without a mark belongs to a replica that died or stalled past a lease
-- TTL: it leaves the queue (its replica, if alive, re-adds it with its score at its next
-- ask), or it would rank ahead of every newcomer for good.
local adm, own, queue = KEYS[1], KEYS[2], KEYS[3]
local session, free_slots, limit = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local marks = string.sub(KEYS[5], 1, #KEYS[5] - #session)
reap(adm, own, ARGV[4])
if not redis.call('ZSCORE', adm, session) then
  for i = 6, #KEYS do
    local expiry = redis.call('ZSCORE', KEYS[i], session)
    if expiry and tonumber(expiry) > tonumber(ARGV[4]) then
      redis.call('ZREM', queue, session)
      return KEYS[i]
    end
  end
end
local rank = redis.call('ZRANK', queue, session)
if not rank then
  if redis.call('ZSCORE', adm, session) then
    grant(adm, own, session, ARGV[5], ARGV[6], KEYS[4])
    return 1
  end
  if ARGV[7] == '' then
    return 0
  end
end
if ARGV[7] ~= '' then
  redis.call('ZADD', queue, ARGV[7], session)
  rank = redis.call('ZRANK', queue, session)
end
redis.call('SET', KEYS[5], '1', 'PX', tonumber(ARGV[5]) - tonumber(ARGV[4]))
if rank >= free_slots and free_slots > 0 then
  -- Count the live entries ahead, up to free_slots; the dead ones found go.
  local live, i, dead = 0, 0, {}
  while live < free_slots and i < rank do
    local chunk = redis.call('ZRANGE', queue, i, math.min(rank, i + 64) - 1)
    for _, s in ipairs(chunk) do
      if redis.call('EXISTS', marks .. s) == 1 then
        live = live + 1
        if live >= free_slots then
          break
        end
      else
        dead[#dead + 1] = s
      end
    end
    i = i + #chunk
  end
  for j = 1, #dead, 1000 do
    redis.call('ZREM', queue, unpack(dead, j, math.min(j + 999, #dead)))
  end
  rank = live
end
if rank >= free_slots or redis.call('ZCARD', adm) >= limit then
  return 0
end
grant(adm, own, session, ARGV[5], ARGV[6], KEYS[4])
redis.call('ZREM', queue, session)
return 1
