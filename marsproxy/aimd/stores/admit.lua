-- KEYS: adm (lease ZSET of one worker), own (session -> replica)
-- ARGV: session, limit, now_ms, expiry_ms, replica
-- Returns 1 when admitted (or already admitted: renewed), 0 when the worker is full.
local adm, own = KEYS[1], KEYS[2]
local session, limit, now_ms = ARGV[1], tonumber(ARGV[2]), ARGV[3]
reap(adm, own, now_ms)
if redis.call('ZSCORE', adm, session) or redis.call('ZCARD', adm) < limit then
  grant(adm, own, session, ARGV[4], ARGV[5])
  return 1
end
return 0
