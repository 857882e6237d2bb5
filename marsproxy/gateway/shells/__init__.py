"""The asyncio shells around the pure cores: admission (with its store), the scheduler, the
priority probe, telemetry wiring, the session table, the per-request outcome, deadlines, event
rates, metrics and the gateway's service object that holds them."""
