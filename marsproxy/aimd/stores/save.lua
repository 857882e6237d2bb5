-- KEYS: sess (the session's record), own (its worker's lease owners), tomb (its tombstone)
-- ARGV: record, ttl_ms, replica, session
-- Writes a session's record unless another replica owns its lease or the session ended. A
-- replica the session left learns it at its next heartbeat: until then its writes would put
-- older turns over the new holder's. A write after the end would bring back the record the
-- end deleted. Returns 1 when written.
local owner = redis.call('HGET', KEYS[2], ARGV[4])
if (owner and owner ~= ARGV[3]) or redis.call('EXISTS', KEYS[3]) == 1 then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
