"""Tests of bridge/nats: bootstrap, connection options, lookups by message id."""
