-- KEYS: leader, windows   ARGV: replica, worker, record_json, worker, record_json...
-- Fenced by the leader key: a deposed leader that has not noticed yet cannot overwrite.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[2])
for i = 2, #ARGV, 2 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
end
return 1
