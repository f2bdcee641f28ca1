"""``python -m hookline.dispatcher`` starts the service, as ``hookline dispatcher`` does."""

from hookline.dispatcher.service import main

main()
