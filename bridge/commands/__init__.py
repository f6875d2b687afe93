"""Subcommand groups of the aep-bridge CLI (thin: parse, then call into the package).

Their imports of the rest of the bridge are inside each command's function, so that
``aep-bridge --help`` does not load every service (the figure is in ``bridge/cli.py``).
"""
