-- KEYS: replicas (ZSET replica -> expiry), epoch (the pool's marker)
-- ARGV: now_ms, expiry_ms, replica, epoch candidate (a fresh random token)
-- Registers this replica as live and returns how many are (local mode divides windows by it),
-- and the pool's epoch: set once by whoever finds none, never expiring. Another epoch than the
-- one a replica saw last means Redis lost the pool's state (restarted empty between two ops).
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
redis.call('SET', KEYS[2], ARGV[4], 'NX')
return {redis.call('ZCARD', KEYS[1]), redis.call('GET', KEYS[2])}
