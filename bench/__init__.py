"""``make bench``: hookline's throughput, latency and memory, beside baselines measured in the same run."""
