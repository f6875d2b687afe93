"""Data files shipped with the package: the real-session corpus and the vendored AEP spec (no code)."""
