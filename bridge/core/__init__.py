"""The pure core: envelopes, AEP types, capture, mapping, lanes, identity, pairing, invariants, control.

No I/O, no asyncio, no NATS: the standard library and msgspec only (contracts in pyproject.toml).
The AEP-0005 projections are in ``bridges/``.
"""
