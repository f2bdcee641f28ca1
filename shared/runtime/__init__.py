"""A hookline process: settings read once at start, structured logs, the event loop and signals, loops
kept running, traces, and what every HTTP API shares (bearer tokens, error bodies, probes, serving)."""
