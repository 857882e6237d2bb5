-- KEYS: adm, own, queue   ARGV: session, wake-up channel
-- Returns 1 when a lease was dropped. Then a slot is free: wake the replicas, but only when
-- sessions wait in the global queue (nobody else listens; a publish per release costs every
-- replica a message to parse).
local n = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if n > 0 and redis.call('ZCARD', KEYS[3]) > 0 then
  redis.call('PUBLISH', ARGV[2], 'release')
end
return n
