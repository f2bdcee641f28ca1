"""The ingest service: the HTTP API for events and endpoints."""
