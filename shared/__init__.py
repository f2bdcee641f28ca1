"""Code common to every hookline service: models, settings, topology, signing, logging."""

__version__ = "0.1.0"
