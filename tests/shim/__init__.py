"""Tests of bridge/shim/hook.py: the hook as Hermes runs it, its publish path, spool and control moments."""
