"""The dispatcher service: consumes endpoint queues, signs, POSTs, and settles every message exactly once."""
