-- KEYS: adm, own, queue   ARGV: now_ms, expiry_ms, replica, tomb key prefix, session...
-- After an outage: make Redis hold exactly this replica's local leases on one worker. Own
-- leases not listed were released while Redis was away: dropped. Listed ones are (re-)added;
-- ZADD of an existing member only re-scores it, so nothing is counted twice. A session that
-- another replica now owns has moved there, and one with a tombstone was ended by another
-- replica meanwhile: both are left alone and returned, to be forgotten locally. (Tombstone
-- keys are built here from the pool's prefix: they share its hash tag, so its slot.)
-- Last, no session with a live lease here waits in the global queue: a failover that lost
-- the queue removal of a session admitted just before it leaves an entry that would rank
-- ahead of every newcomer for good.
local adm, own, replica = KEYS[1], KEYS[2], ARGV[3]
reap(adm, own, ARGV[1])
local keep = {}
local tomb = ARGV[4]
for i = 5, #ARGV do
  keep[ARGV[i]] = true
end
local stale = {}
local owners = redis.call('HGETALL', own)
for i = 1, #owners, 2 do
  if owners[i + 1] == replica and not keep[owners[i]] then
    stale[#stale + 1] = owners[i]
  end
end
remove_all(adm, own, stale)
local moved = {}
for i = 5, #ARGV do
  local s = ARGV[i]
  local owner = redis.call('HGET', own, s)
  if (owner and owner ~= replica) or (not owner and redis.call('EXISTS', tomb .. s) == 1) then
    moved[#moved + 1] = s
  else
    grant(adm, own, s, ARGV[2], replica)
  end
end
for _, s in ipairs(redis.call('ZRANGE', adm, 0, -1)) do
  redis.call('ZREM', KEYS[3], s)
end
return moved
