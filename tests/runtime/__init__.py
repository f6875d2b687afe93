"""Tests of bridge/runtime: the lifecycle every service shares (`serve`), on a real nats-server, and its logging."""
