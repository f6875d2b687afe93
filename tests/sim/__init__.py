"""Tests of bridge/sim: the fleet simulator, the verifier and the fault scenarios built on them."""
