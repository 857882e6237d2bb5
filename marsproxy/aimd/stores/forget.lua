-- KEYS: sess (a session's record), own... (the lease owners of the workers the replica knows)
-- ARGV: replica, session
-- A record this replica deleted while cut off from Redis (its session ended here), deleted on
-- resync unless another replica owns the session's lease: it moved there meanwhile, and the
-- record is that replica's now. Returns 1 when deleted.
for i = 2, #KEYS do
  local owner = redis.call('HGET', KEYS[i], ARGV[2])
  if owner and owner ~= ARGV[1] then
    return 0
  end
end
return redis.call('DEL', KEYS[1])
