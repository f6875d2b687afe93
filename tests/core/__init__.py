"""Tests of bridge/core: the pure mapping, capture, identity, lanes, control protocol and pairing state machine."""
