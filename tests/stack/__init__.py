"""Tests of the one-machine stack (bridge/stack): `aep-bridge up`, `demo` and `tail`."""
