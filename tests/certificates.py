"""Certificates for TLS tests, made with `cryptography`: a certificate authority, and leaf certificates it signs
for a server (names localhost and 127.0.0.1) or a client. PEM text, as TensorFlow Serving's SSLConfig holds it."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pem:
    key: str
    cert: str


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


def _builder(subject: str, issuer: x509.Name, public_key, not_after=None) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(not_after or now + datetime.timedelta(days=2))
    )


class Authority:
    """A self-signed certificate authority that signs leaf certificates."""

    def __init__(self, name: str = "servex test CA"):
        self._key = _key()
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self._cert = (
            _builder(name, self.name, self._key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.cert = self._cert.public_bytes(serialization.Encoding.PEM).decode()

    def _leaf(self, subject: str, usage, names: list[x509.GeneralName], not_after=None) -> Pem:
        key = _key()
        builder = (
            _builder(subject, self.name, key.public_key(), not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return Pem(_key_pem(key), cert.public_bytes(serialization.Encoding.PEM).decode())

    def server(self, not_after: datetime.datetime | None = None) -> Pem:
        """A server certificate for localhost and 127.0.0.1, valid for two days or until ``not_after``."""
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        return self._leaf("localhost", ExtendedKeyUsageOID.SERVER_AUTH, names, not_after)

    def client(self, subject: str = "servex test client") -> Pem:
        return self._leaf(subject, ExtendedKeyUsageOID.CLIENT_AUTH, [])


def ssl_config(server: Pem, custom_ca: str = "", client_verify: bool = False) -> str:
    """TensorFlow Serving's SSLConfig in text format, as people write it: each PEM line a string of its own (text
    format joins adjacent strings)."""

    def field(name: str, pem: str) -> str:
        lines = "".join(f'  "{line}\\n"\n' for line in pem.splitlines())
        return f"{name}:\n{lines}"

    text = field("server_key", server.key) + field("server_cert", server.cert)
    if custom_ca:
        text += field("custom_ca", custom_ca)
    return text + f"client_verify: {str(client_verify).lower()}\n"
