"""The simulated fleet: what an instance plays, how the fleet publishes, verify."""
