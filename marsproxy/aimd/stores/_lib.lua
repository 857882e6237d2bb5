-- Shared by every lease script (prepended when loaded). Lease ZSET members are sessions scored
-- by expiry (epoch ms); the owner hash maps session -> replica id for heartbeat renewal.

-- ZREM/HDEL in chunks: unpack() of a huge list overflows the Lua C stack (~8000 slots).
local function remove_all(adm, own, members)
  for i = 1, #members, 1000 do
    local chunk = {unpack(members, i, math.min(i + 999, #members))}
    redis.call('ZREM', adm, unpack(chunk))
    redis.call('HDEL', own, unpack(chunk))
  end
end

-- Reaping inside every check is what returns a crashed replica's slots within one lease TTL.
local function reap(adm, own, now_ms)
  remove_all(adm, own, redis.call('ZRANGE', adm, '-inf', now_ms, 'BYSCORE'))
end

-- tomb: the session's tombstone key; a new admission under an ended session's id clears it.
local function grant(adm, own, session, expiry_ms, replica, tomb)
  redis.call('ZADD', adm, expiry_ms, session)
  redis.call('HSET', own, session, replica)
  if tomb then
    redis.call('DEL', tomb)
  end
end
