"""Hermes wiring: ``install`` (install / uninstall, the config.yaml and allowlist formats) and ``doctor``."""
