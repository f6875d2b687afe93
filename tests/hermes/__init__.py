"""Tests of the Hermes wiring (install, uninstall, doctor) and of the bridge under the real hermes-agent."""
