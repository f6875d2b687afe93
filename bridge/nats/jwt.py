"""NATS JWT claims (ADR-14, version 2): nkey pairs, encoding, decoding, ``.creds`` files.

The one place the bridge writes NATS's decentralized-auth claims (`aep-bridge fleet`,
bridge/nats/fleet.py). No well-kept Python library encodes them (``nats-jwt`` calls itself
development-stage), so this module does, with the official ``nkeys`` package as the signer:

* a JWT is ``base64url(header) "." base64url(claims) "." base64url(signature)``, unpadded,
  header ``{"typ":"JWT","alg":"ed25519-nkey"}``, the signature the issuer nkey's Ed25519
  signature of the first two parts;
* the claims: ``jti`` (base32 of the SHA-512/256 of the claims without it), ``iat``, ``iss``
  (the signer's public nkey), ``sub`` (the subject's public nkey), ``name``, ``exp``
  (optional) and ``nats`` (``type``: operator | account | user, ``version``: 2, and the
  type's fields).

Every shape written here is accepted by a real nats-server in tests/nats/test_fleet.py.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import nacl.signing
import nkeys

HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}

PREFIXES = {
    "operator": nkeys.PREFIX_BYTE_OPERATOR,
    "account": nkeys.PREFIX_BYTE_ACCOUNT,
    "user": nkeys.PREFIX_BYTE_USER,
}

#: Account limits meaning "no limit" (-1), JetStream enabled (storage -1) where asked.
NO_LIMITS = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True,
             "conn": -1, "leaf": -1}
JETSTREAM_UNLIMITED = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}


class JwtError(ValueError):
    """A JWT or creds file that cannot be read, or whose signature does not verify."""


@dataclass(frozen=True)
class Key:
    """An nkey pair: ``public`` (``O…``, ``A…``, ``U…``) and its ``seed`` (``SO…``, ``SA…``, ``SU…``)."""

    public: str
    seed: str

    @classmethod
    def new(cls, kind: str) -> "Key":
        seed = nkeys.encode_seed(os.urandom(32), PREFIXES[kind])
        return cls(nkeys.from_seed(bytearray(seed)).public_key.decode(), seed.decode())

    @classmethod
    def from_seed(cls, seed: str) -> "Key":
        return cls(nkeys.from_seed(bytearray(seed.encode())).public_key.decode(), seed)

    def sign(self, data: bytes) -> bytes:
        return bytes(nkeys.from_seed(bytearray(self.seed.encode())).sign(data))


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def encode(claims: dict[str, Any], signer: Key) -> str:
    """Sign ``claims`` (``jti`` and ``iss`` are set here) with ``signer``."""
    claims = dict(claims)
    claims.pop("jti", None)
    claims["iss"] = signer.public
    claims.setdefault("iat", int(time.time()))
    body = json.dumps(claims, separators=(",", ":"), sort_keys=True).encode()
    claims["jti"] = base64.b32encode(hashlib.new("sha512_256", body).digest()).decode().rstrip("=")
    head = b64(json.dumps(HEADER, separators=(",", ":")).encode())
    payload = b64(json.dumps(claims, separators=(",", ":"), sort_keys=True).encode())
    signature = signer.sign(f"{head}.{payload}".encode())
    return f"{head}.{payload}.{b64(signature)}"


def decode(token: str, verify: bool = True) -> dict[str, Any]:
    """The claims of ``token``; with ``verify``, its signature checked against ``iss``."""
    try:
        head, payload, signature = token.strip().split(".")
        header = json.loads(unb64(head))
        claims = json.loads(unb64(payload))
    except (ValueError, TypeError) as exc:
        raise JwtError(f"not a JWT: {exc}") from None
    if header.get("alg") not in ("ed25519-nkey", "ed25519") or not isinstance(claims, dict):
        raise JwtError(f"not a NATS JWT (header {header})")
    if verify:
        try:
            raw = base64.b32decode(claims["iss"] + "=" * (-len(claims["iss"]) % 8))[1:33]
            nacl.signing.VerifyKey(raw).verify(f"{head}.{payload}".encode(), unb64(signature))
        except Exception as exc:  # nkeys raises its own errors (and nacl's) for a bad key or signature
            raise JwtError(f"the JWT's signature does not verify: {type(exc).__name__}") from None
    return claims


def claims(kind: str, subject: str, name: str, nats: dict[str, Any], expires: int | None = None,
           issued: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"sub": subject, "name": name, "iat": issued or int(time.time()),
                           "nats": {"type": kind, "version": 2, **nats}}
    if expires:
        out["exp"] = int(expires)
    return out


CREDS = """-----BEGIN NATS USER JWT-----
{jwt}
------END NATS USER JWT------

************************* IMPORTANT *************************
NKEY Seed printed below can be used to sign and prove identity.
NKEYs are sensitive and should be treated as secrets.

-----BEGIN USER NKEY SEED-----
{seed}
------END USER NKEY SEED------

*************************************************************
"""


def creds(jwt: str, seed: str) -> str:
    """A ``.creds`` file (the form nats-py's ``user_credentials`` and `nats` CLI read)."""
    return CREDS.format(jwt=jwt, seed=seed)


def creds_jwt(text: str) -> str:
    """The JWT of a ``.creds`` file's text."""
    lines = [ln.strip() for ln in text.splitlines()]
    try:
        start = next(i for i, ln in enumerate(lines) if "BEGIN NATS USER JWT" in ln)
    except StopIteration:
        raise JwtError("no NATS USER JWT block in the creds file") from None
    for ln in lines[start + 1:]:
        if ln and not ln.startswith("--"):
            return ln
    raise JwtError("empty NATS USER JWT block in the creds file")
