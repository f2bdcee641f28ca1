"""The health-monitor service: latency percentiles, circuit breakers, alerts, status."""
