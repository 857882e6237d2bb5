-- KEYS: leader   ARGV: replica, ttl_ms
-- The holder renews its lease; anyone takes a free (expired) key with SET NX PX.
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not cur and redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
return 0
