"""The long-running services: mapper, pairing, gate/, exporter/, relay/ (none imports another)."""
