"""The Hermes hook (``hook.py``): one standard-library-only file, run by Hermes for every event."""
