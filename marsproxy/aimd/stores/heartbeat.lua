-- KEYS: replicas (ZSET replica -> expiry)   ARGV: now_ms, expiry_ms, replica
-- Registers this replica as live and returns how many are: local mode divides windows by it.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
return redis.call('ZCARD', KEYS[1])
