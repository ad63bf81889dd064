"""TLS for the gRPC ports: TensorFlow Serving's --ssl_config_file (a text-format SSLConfig holding PEM text), or
servex's PEM file flags (--ssl_server_cert_file, --ssl_server_key_file, --ssl_custom_ca_file, as a Kubernetes TLS
Secret holds them), read and checked at start, and the gRPC server credentials made from them, which follow the
files when they change.

The checks use the standard library's ssl module, so that a bad file stops servex at start with a line naming the
field at fault; gRPC itself would only fail to bind ("Failed to bind to address"), or load a CA that verifies no
client. As in TensorFlow Serving, `client_verify` makes the server require a client certificate that `custom_ca`
signed; without it no client certificate is asked for.

Rotation (servex's own; TensorFlow Serving reads the file once): gRPC asks `Certificates` before every TLS
handshake whether the certificate changed. It looks at the files' modification times, sizes and inodes (a stat
each), and when they change reads and checks them again: new connections then get the new key, certificate and
CA, while open ones keep theirs. Files that cannot serve are logged and the certificate in use kept.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import ssl
import threading
import time
from pathlib import Path

from google.protobuf import text_format

from servex.server.config.settings import TlsSettings

log = logging.getLogger("servex")


class TlsConfigError(ValueError):
    """The SSLConfig cannot serve TLS; the message names the file and the field."""


class TlsReadError(TlsConfigError):
    """A file could not be read (missing, unreadable, no descriptor free): maybe for a moment only."""


def read_ssl_config(path: str) -> TlsSettings:
    """The checked TLS settings of the SSLConfig file at ``path``; TlsConfigError saying what is wrong."""
    from servex.protos.servex.v1 import ssl_config_pb2

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise TlsReadError(f"cannot read {path!r}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise TlsConfigError(f"{path!r} is not text: an SSLConfig in text format holds PEM text") from None
    try:
        config = text_format.Parse(text, ssl_config_pb2.SSLConfig())
    except text_format.ParseError as e:
        raise TlsConfigError(
            f"{path!r} is not an SSLConfig in text format (server_key, server_cert, custom_ca, client_verify): {e}"
        ) from None
    tls = TlsSettings(config.server_key, config.server_cert, config.custom_ca, config.client_verify, sources=(path,))
    try:
        check(tls)
    except TlsConfigError as e:
        raise type(e)(f"{path!r}: {e}") from None
    return tls


RETRY_S = 1.0  # after a failed read, how long before the files are read again

# The PEM file flags, by the SSLConfig field each one fills.
PEM_FLAGS = {"server_cert": "--ssl_server_cert_file", "server_key": "--ssl_server_key_file",
             "custom_ca": "--ssl_custom_ca_file"}  # fmt: skip


def read_pem_files(cert_file: str, key_file: str, ca_file: str = "", client_verify: bool = False) -> TlsSettings:
    """The checked TLS settings of the PEM file flags; TlsConfigError naming the flag and file at fault."""
    paths = {"server_cert": cert_file, "server_key": key_file, "custom_ca": ca_file}
    texts = {}
    for field, path in paths.items():
        try:
            texts[field] = Path(path).read_text(encoding="utf-8") if path else ""
        except OSError as e:
            raise TlsReadError(f"{PEM_FLAGS[field]}: cannot read {path!r}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise TlsConfigError(f"{PEM_FLAGS[field]}: {path!r} is not PEM text") from None
    tls = TlsSettings(texts["server_key"], texts["server_cert"], texts["custom_ca"], client_verify,
                      sources=(cert_file, key_file, ca_file))  # fmt: skip
    check(tls, {field: f"{PEM_FLAGS[field]} ({paths[field]!r})" for field in paths})
    return tls


def check(tls: TlsSettings, names: dict[str, str] | None = None) -> None:
    """TlsConfigError unless the key and certificate chain parse and match, and custom_ca parses (and is given
    where client_verify asks for it). ``names``: what the messages call each field (default: SSLConfig's names)."""
    name = names or {field: field for field in PEM_FLAGS}
    for field in PEM_FLAGS:  # OpenSSL's PEM reader skips past one, gRPC takes the text as a C string: cut at it
        if "\0" in getattr(tls, field):
            raise TlsConfigError(f"{name[field]} holds a NUL character: gRPC would read its PEM text only up to it")
    for field, value in (("server_key", tls.server_key), ("server_cert", tls.server_cert)):
        if not value.strip():
            hint = "" if names else ": it holds the PEM text itself (-----BEGIN ...), not a file path"
            raise TlsConfigError(f"{name[field]} is empty{hint}")
    if "ENCRYPTED" in tls.server_key:
        raise TlsConfigError(f"{name['server_key']} is encrypted: gRPC takes an unencrypted PEM private key")
    _certificates(name["server_cert"], tls.server_cert)
    if tls.custom_ca.strip():
        _certificates(name["custom_ca"], tls.custom_ca)
    elif tls.client_verify:
        raise TlsConfigError(
            f"client_verify is true but {name['custom_ca']} is empty: client certificates must chain to it"
        )
    try:
        _load_pair(tls.server_cert, tls.server_key)
    except ssl.SSLError as e:
        if "KEY_VALUES_MISMATCH" in str(e):
            raise TlsConfigError(
                f"{name['server_key']} is not the private key of {name['server_cert']}'s first certificate"
            ) from None
        raise TlsConfigError(f"{name['server_key']} is not a PEM private key ({e.reason or e})") from None


def _load_pair(cert: str, key: str) -> None:
    """Load the pair as a TLS server would (ssl.SSLError when it cannot serve). The ssl module reads keys from
    files only: these are anonymous memory files (memfd), so the key never reaches a disk. Where there are none,
    nothing is checked here: gRPC refuses a bad pair when it binds, less clearly."""
    try:
        files = [os.memfd_create("servex-tls-cert"), os.memfd_create("servex-tls-key")]
    except (AttributeError, OSError):
        return
    try:
        for fd, text in zip(files, (cert, key), strict=True):
            with os.fdopen(os.dup(fd), "w", encoding="utf-8") as f:
                f.write(text)
        paths = [f"/proc/self/fd/{fd}" for fd in files]
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(*paths, password=_no_password)
    finally:
        for fd in files:
            os.close(fd)


PEM_CERTIFICATE = re.compile(r"-----BEGIN CERTIFICATE-----[^-]*-----END CERTIFICATE-----")


def _certificates(field: str, text: str) -> None:
    blocks = PEM_CERTIFICATE.findall(text)  # text around them (a bundle's comments, in any script) is not checked
    if not blocks:
        raise TlsConfigError(f"{field} holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata="\n".join(blocks))
    except (ssl.SSLError, ValueError, TypeError) as e:  # TypeError: a non-ASCII character inside a block
        raise TlsConfigError(f"{field} is not PEM certificates ({getattr(e, 'reason', None) or e})") from None


def _no_password() -> bytes:
    raise TlsConfigError("the private key is encrypted: gRPC takes an unencrypted PEM private key")


def not_after(cert_pem: str) -> float | None:
    """When the first certificate of a PEM chain expires (its notAfter, Unix time); None where it cannot be read.

    The ssl module decodes no certificate given as text, so this walks the DER far enough to reach the date
    (RFC 5280: Certificate > tbsCertificate > [version], serialNumber, signature, issuer, validity > notAfter)."""
    blocks = PEM_CERTIFICATE.findall(cert_pem)
    try:
        der = ssl.PEM_cert_to_DER_cert(blocks[0])
        _, start, end = _tlv(der, 0)  # Certificate
        _, start, end = _tlv(der, start)  # tbsCertificate
        fields = [element for element in _elements(der, start, end) if element[0] != 0xA0]  # [0] version: optional
        _, start, end = fields[3]  # validity
        tag, start, end = list(_elements(der, start, end))[1]  # notAfter
        text = der[start:end].decode("ascii")
        if tag == 0x17:  # UTCTime, YYMMDDHHMMSSZ: years 1950-2049
            year = int(text[:2])
            text = f"{year + (1900 if year >= 50 else 2000)}{text[2:]}"
        elif tag != 0x18:  # GeneralizedTime, YYYYMMDDHHMMSSZ
            return None
        when = datetime.datetime.strptime(text, "%Y%m%d%H%M%SZ").replace(tzinfo=datetime.UTC)
    except (IndexError, ValueError, UnicodeDecodeError):
        return None
    return when.timestamp()


def _tlv(der: bytes, at: int) -> tuple[int, int, int]:
    """The tag of the DER element at ``at``, and where its value starts and ends."""
    tag, length, at = der[at], der[at + 1], at + 2
    if length & 0x80:  # long form: the next (length & 0x7F) bytes are the length
        size = length & 0x7F
        length, at = int.from_bytes(der[at : at + size], "big"), at + size
    if at + length > len(der):
        raise ValueError("truncated DER")
    return tag, at, at + length


def _elements(der: bytes, start: int, end: int):
    while start < end:
        element = _tlv(der, start)
        yield element
        start = element[2]


class Certificates:
    """The gRPC server credentials of ``tls``: TensorFlow Serving's, a client certificate required and verified
    against custom_ca when client_verify is set. Where ``tls`` was read from files (``sources``), the credentials
    follow it: see the module's docstring. One object per process; ``credentials()`` for each listener."""

    def __init__(self, tls: TlsSettings):
        self.tls = tls
        self._configuration = _configuration(tls)
        self._generation = 0  # bumped at each certificate change
        self._stamp = _stamps(tls.sources)
        self._retry_at = 0.0  # after a failed read, the files are read again from then on
        self._reported = None  # the files' state whose failure to read was logged
        self._lock = threading.Lock()
        # the metrics (not imported at module level: server/cli.py reads TLS files before TensorFlow is imported,
        # and server/observability/metrics.py imports it), labelled by the certificate's file
        from servex.server.observability.metrics import TLS_NOT_AFTER, TLS_OUTCOMES, TLS_RELOADS

        file = tls.sources[0] if tls.sources else ""
        self._not_after = TLS_NOT_AFTER.labels(file)
        self._reloads = {outcome: TLS_RELOADS.labels(file, outcome) for outcome in TLS_OUTCOMES}
        self._expiry()

    def credentials(self):
        """Server credentials for one listener (each keeps which certificate it serves). Settings read from no file
        (``sources`` empty) never change: their fetcher always keeps the certificate."""
        import grpc

        return grpc.dynamic_ssl_server_credentials(self._configuration, self.fetcher(), self.tls.client_verify)

    def fetcher(self):
        """What gRPC calls, on one of its threads, before each TLS handshake of one listener: the certificate
        configuration that listener should change to, or None to keep its own. It never raises."""
        served = [self._generation]

        def fetch():
            try:
                self._follow_files()
            except Exception:  # noqa: BLE001  (an exception here would fail the client's handshake, not servex)
                log.exception("TLS: checking %s failed: keeping the certificate in use", self._files())
                self._retry_at = time.monotonic() + RETRY_S
            if served[0] == self._generation:
                return None
            served[0] = self._generation
            return self._configuration

        return fetch

    def _files(self) -> str:
        return ", ".join(p for p in self.tls.sources if p)

    def _follow_files(self) -> None:
        stamp = _stamps(self.tls.sources)
        if stamp == self._stamp or time.monotonic() < self._retry_at:
            return
        with self._lock:
            if stamp == self._stamp or time.monotonic() < self._retry_at:
                return
            try:
                tls = _reread(self.tls)
            except TlsReadError as e:  # maybe for a moment (a file being replaced): tried again after RETRY_S
                self._retry_at = time.monotonic() + RETRY_S
                self._reloads["unreadable"].inc()
                self._report(stamp, "TLS: %s changed and cannot be read now: keeping the certificate in use, "
                             "trying again: %s", self._files(), e)  # fmt: skip
                return
            except TlsConfigError as e:  # these contents cannot serve: the next change is looked at
                self._stamp = stamp
                self._reloads["refused"].inc()
                log.error("TLS: %s changed and cannot serve: keeping the certificate in use: %s", self._files(), e)
                return
            self._stamp = stamp
            if tls.client_verify != self.tls.client_verify:
                self._reloads["refused"].inc()
                log.error("TLS: %s changed client_verify to %s: keeping the certificate in use (client_verify "
                          "is fixed while servex runs: restart to change it)", self._files(),
                          tls.client_verify)  # fmt: skip
                return
            if tls == self.tls:
                return  # touched, not changed
            self.tls, self._configuration = tls, _configuration(tls)
            self._generation += 1
            self._reloads["rotated"].inc()
            self._expiry()
        log.info("TLS: %s changed: new connections get its certificate", self._files())

    def _expiry(self) -> None:
        expires = not_after(self.tls.server_cert)
        if expires is not None:
            self._not_after.set(expires)

    def _report(self, stamp, message: str, *args) -> None:
        """Log a failure once per state of the files, not at every retry."""
        if stamp != self._reported:
            self._reported = stamp
            log.error(message, *args)


def _reread(tls: TlsSettings) -> TlsSettings:
    if len(tls.sources) == 1:  # an SSLConfig file
        return read_ssl_config(tls.sources[0])
    return read_pem_files(*tls.sources, client_verify=tls.client_verify)


def _configuration(tls: TlsSettings):
    import grpc

    return grpc.ssl_server_certificate_configuration(
        [(tls.server_key.encode(), tls.server_cert.encode())],
        root_certificates=tls.custom_ca.encode() if tls.custom_ca.strip() else None,
    )


def _stamps(paths: tuple[str, ...]) -> tuple:
    """What changes when a file is written or replaced (a Kubernetes Secret volume swaps a symbolic link)."""

    def stamp(path: str) -> tuple[int, int, int] | None:
        try:
            info = os.stat(path)
        except OSError:
            return None
        return info.st_mtime_ns, info.st_size, info.st_ino

    return tuple(stamp(p) for p in paths if p)
