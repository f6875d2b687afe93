"""NATS for the bridge: subjects, stream / KV specs, bootstrap, connections, the lane KV, look-ups."""
