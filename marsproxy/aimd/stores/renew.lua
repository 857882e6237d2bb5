-- KEYS: adm, own   ARGV: now_ms, expiry_ms, replica, session...
-- Heartbeat for one worker: renews the listed leases while this replica still owns them.
-- Never re-adds a missing lease (it was released elsewhere or expired and its slot may be
-- reused); returns those sessions so the replica forgets them.
local adm, own, replica = KEYS[1], KEYS[2], ARGV[3]
reap(adm, own, ARGV[1])
local gone = {}
for i = 4, #ARGV do
  local s = ARGV[i]
  if redis.call('HGET', own, s) == replica and redis.call('ZSCORE', adm, s) then
    redis.call('ZADD', adm, 'XX', ARGV[2], s)
  else
    gone[#gone + 1] = s
  end
end
return gone
