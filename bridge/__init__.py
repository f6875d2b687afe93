"""aep-bridge: Hermes Agent hook events -> AEP 0.1 events on NATS JetStream."""

__version__ = "0.1.0"
