"""Tests of the `aep-bridge` commands as a new user meets them: the real command as a process,
default settings, no settings file, a clean environment (issue 38)."""
