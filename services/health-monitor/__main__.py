"""``python -m hookline.health_monitor`` starts the service, as ``hookline health-monitor`` does."""

from hookline.health_monitor.service import main

main()
