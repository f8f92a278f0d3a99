"""torpor: agent sessions that sleep in object storage and wake once on a signed webhook."""

__version__ = "0.1.0"
