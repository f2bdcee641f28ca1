"""``python -m hookline.ingest`` starts the service, as ``hookline ingest`` does."""

from hookline.ingest.service import main

main()
