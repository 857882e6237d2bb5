"""The gateway's HTTP plumbing: the aiohttp app and server loop, the relay to the workers
(upstream client, SSE tap, bodies), error answers, routes, health, auth and limits."""
