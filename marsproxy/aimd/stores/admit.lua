-- KEYS: adm (lease ZSET of one worker), own (session -> replica), tomb (the session's tombstone)
-- ARGV: session, limit, now_ms, expiry_ms, replica
-- Returns 1 when admitted (or already admitted: renewed, and now owned by this replica), 0
-- when the worker is full. With limit 0 it only takes over a live lease: how a replica adopts
-- a session that another replica admitted.
local adm, own = KEYS[1], KEYS[2]
local session, limit, now_ms = ARGV[1], tonumber(ARGV[2]), ARGV[3]
reap(adm, own, now_ms)
if redis.call('ZSCORE', adm, session) or redis.call('ZCARD', adm) < limit then
  grant(adm, own, session, ARGV[4], ARGV[5], KEYS[3])
  return 1
end
return 0
