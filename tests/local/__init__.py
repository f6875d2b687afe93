"""Tests of the one-machine stack (bridge/local): `aep-bridge up`, `demo` and `tail`."""
