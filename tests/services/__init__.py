"""Tests of bridge/services: the mapper, pairing and gate services on a real nats-server, and their runtime."""
