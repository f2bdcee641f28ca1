"""State every replica derives from the change log (the stream ``hookline.endpoints``): endpoints and
their versions, the event-type catalog, tenants' tokens and quotas, tenant notifications, the dead-letter
index; and the SQLite files that keep it on local disk across restarts."""
