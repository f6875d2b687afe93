"""Helpers shared by the tests (no fixtures here: those live in tests/conftest.py)."""
