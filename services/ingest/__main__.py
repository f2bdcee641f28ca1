"""``python -m hookline.ingest`` starts the service, as ``hookline ingest`` does."""

from hookline.ingest.app import main

main()
