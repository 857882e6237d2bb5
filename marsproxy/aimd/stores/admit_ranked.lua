-- KEYS: adm, own, queue (global waiting ZSET, lowest score first), tomb
-- ARGV: session, free_slots, limit, now_ms, expiry_ms, replica, score ('' = do not enqueue)
-- Admits a waiting session only while it is among the first free_slots of the global queue and
-- the worker has room, and takes it out of the queue in the same step: order holds across
-- replicas. With a score, a session not yet waiting joins the queue first, and one waiting
-- takes the new score (the policy's order moves as tenants are served): one round trip for
-- both. Returns 1 admitted (or already admitted), 0 not yet.
local adm, own, queue = KEYS[1], KEYS[2], KEYS[3]
local session, free_slots, limit = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
reap(adm, own, ARGV[4])
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
if rank >= free_slots or redis.call('ZCARD', adm) >= limit then
  return 0
end
grant(adm, own, session, ARGV[5], ARGV[6], KEYS[4])
redis.call('ZREM', queue, session)
return 1
