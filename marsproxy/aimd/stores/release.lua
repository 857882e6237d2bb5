-- KEYS: adm, own, queue, sess (the session's record), tomb (its tombstone)
-- ARGV: session, wake-up channel, replica ('' = whoever holds it), tomb_ttl_ms
-- Ends a session: drops its lease and its record, and leaves a tombstone so that a replica
-- that was cut off from Redis meanwhile does not write the lease back on resync.
-- Fenced: a replica ends only a lease it owns (the session may have moved to another
-- replica, which now serves it): then nothing changes and -1 comes back. Else returns 1 when
-- a lease was dropped (exactly once, whoever asks), 0 when there was none. A dropped lease
-- frees a slot: wake the replicas, but only when sessions wait in the global queue (nobody
-- else listens; a publish per release costs every replica a message to parse).
local session, replica = ARGV[1], ARGV[3]
if replica ~= '' then
  local owner = redis.call('HGET', KEYS[2], session)
  if owner and owner ~= replica then
    return -1
  end
end
local n = redis.call('ZREM', KEYS[1], session)
if n > 0 then
  -- An admitted session waits nowhere: an entry a failover left behind (its removal lost)
  -- would rank ahead of every newcomer for good.
  redis.call('ZREM', KEYS[3], session)
end
redis.call('HDEL', KEYS[2], session)
redis.call('DEL', KEYS[4])
redis.call('SET', KEYS[5], '1', 'PX', ARGV[4])
if n > 0 and redis.call('ZCARD', KEYS[3]) > 0 then
  redis.call('PUBLISH', ARGV[2], 'release')
end
return n
