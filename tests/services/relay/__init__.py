"""Tests of bridge/services/relay: the AEP gateway (SSE, WebSocket, ingest, control) on a real nats-server."""
