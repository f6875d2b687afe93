"""Subcommand groups of the aep-bridge CLI (thin: parse, then call into the package)."""
