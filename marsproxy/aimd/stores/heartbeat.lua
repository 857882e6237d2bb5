-- KEYS: replicas (ZSET replica -> expiry), epoch (the pool's marker), queue (the global waiting
--   ZSET)
-- ARGV: now_ms, expiry_ms, replica, epoch candidate (a fresh random token), the asked marks'
--   prefix (``Keys.asked_prefix``)
-- Registers this replica as live and returns how many are (local mode divides windows by it),
-- and the pool's epoch: set once by whoever finds none, never expiring. Another epoch than the
-- one a replica saw last means Redis lost the pool's state (restarted empty between two ops).
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
redis.call('SET', KEYS[2], ARGV[4], 'NX')
-- The queue's head loses the entries nobody asked for within a lease TTL (a dead replica's; a
-- live one re-adds its own with its next ask), as admit_ranked.lua drops those ahead of an
-- asker: there may be no asker behind them (the last one was admitted while their marks lived).
local dead = {}
for _, s in ipairs(redis.call('ZRANGE', KEYS[3], 0, 63)) do
  if redis.call('EXISTS', ARGV[5] .. s) == 0 then
    dead[#dead + 1] = s
  end
end
if #dead > 0 then
  redis.call('ZREM', KEYS[3], unpack(dead))
end
return {redis.call('ZCARD', KEYS[1]), redis.call('GET', KEYS[2])}
