"""The ``hookline`` command: start a service, or administer a running system (:mod:`hookline.cli.main`)."""
