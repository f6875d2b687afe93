"""Tests of bridge/services/gate: the control plane (held calls, instructions, cards) on a real nats-server."""
