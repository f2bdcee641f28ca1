"""Calling a customer's URL: where hookline may send (SSRF rules), the outbound client and its timings,
what a request carries (signature, the endpoint's own headers and credentials), secrets sealed at rest,
and what an endpoint chose about its events (filters, transforms)."""
