-- wrk script of the overhead benchmark (marsproxy/bench/overhead_load.py runs it).
-- Arguments after "--": <body file> <delay ms between a connection's requests> <sessions>.
-- Requests rotate over <sessions> x-session-id values (0: no session header); all request
-- strings are built once in init, so request() costs a table lookup. <sessions> "one-call":
-- every request is a session of its own, a new x-session-id with x-session-final: true.
local reqs, n, count, pause = {}, 0, 0, 0
local one_call, headers, body, run = false, nil, nil, ""

function init(args)
  local f = assert(io.open(args[1], "rb"))
  body = f:read("*a")
  f:close()
  pause = tonumber(args[2]) or 0
  if args[3] == "one-call" then
    one_call = true
    -- Ids unique across wrk runs against the same proxy (warm-up, rounds).
    local r = assert(io.open("/dev/urandom", "rb"))
    run = r:read(6):gsub(".", function(c) return string.format("%02x", c:byte()) end)
    r:close()
  end
  local sessions = tonumber(args[3]) or 0
  headers = {["Content-Type"] = "application/json", ["Authorization"] = "Bearer sk-overhead-bench-7f3a9c2e5b1d4068a9e2c7b5d3f1a0e4"}
  if sessions < 1 then
    reqs[1] = wrk.format("POST", nil, headers, body)
    count = 1
  else
    for i = 1, sessions do
      headers["x-session-id"] = "bench-" .. i
      reqs[i] = wrk.format("POST", nil, headers, body)
    end
    count = sessions
  end
end

function request()
  n = n + 1
  if one_call then
    headers["x-session-id"] = "one-" .. run .. "-" .. n
    headers["x-session-final"] = "true"
    return wrk.format("POST", nil, headers, body)
  end
  return reqs[(n % count) + 1]
end

function delay()
  return pause
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'OVERHEAD-JSON {"duration_us":%d,"requests":%d,"bytes":%d,' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
    '"latency_us":{"min":%d,"mean":%.1f,"max":%d,"p50":%d,"p90":%d,"p99":%d,"p999":%d}}\n',
    summary.duration, summary.requests, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency.min, latency.mean, latency.max,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9)))
end
