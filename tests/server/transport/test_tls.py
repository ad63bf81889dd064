"""server/transport/tls.py: TensorFlow Serving's SSLConfig files read, and every way one cannot serve TLS refused at
start
with the field at fault named (gRPC itself would only fail to bind)."""

from __future__ import annotations

import os

import pytest
from cryptography.hazmat.primitives import serialization

from servex.server.config.settings import TlsSettings
from servex.server.transport.tls import Certificates, TlsConfigError, check, not_after, read_pem_files, read_ssl_config
from tests.certificates import Authority, Pem, ssl_config


@pytest.fixture(scope="module")
def authority() -> Authority:
    return Authority()


def test_a_tensorflow_serving_ssl_config_file_is_read(tmp_path, authority):
    server = authority.server()
    path = tmp_path / "ssl.config"
    path.write_text(ssl_config(server))
    assert read_ssl_config(str(path)) == TlsSettings(server.key, server.cert, "", False)
    path.write_text(ssl_config(server, authority.cert, client_verify=True))
    assert read_ssl_config(str(path)) == TlsSettings(server.key, server.cert, authority.cert, True)
    # one string per field, newlines escaped: the other way such files are written
    escaped = server.key.replace("\n", "\\n"), server.cert.replace("\n", "\\n")
    path.write_text(f'server_key: "{escaped[0]}"\nserver_cert: "{escaped[1]}"\n')
    assert read_ssl_config(str(path)) == TlsSettings(server.key, server.cert)


def test_a_file_that_cannot_be_read_or_parsed_is_named(tmp_path):
    missing = tmp_path / "missing.config"
    with pytest.raises(TlsConfigError) as info:
        read_ssl_config(str(missing))
    assert f"cannot read {str(missing)!r}: No such file" in str(info.value)
    path = tmp_path / "ssl.config"
    path.write_text("server_key: 'k'\nserver_certificate: 'c'\n")
    with pytest.raises(TlsConfigError, match=r"is not an SSLConfig in text format .*server_certificate"):
        read_ssl_config(str(path))
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(TlsConfigError, match="is not text"):
        read_ssl_config(str(path))


def test_a_problem_found_in_the_file_names_the_file(tmp_path, authority):
    path = tmp_path / "ssl.config"
    cert = authority.server().cert.replace("\n", "\\n")
    path.write_text(f'server_cert: "{cert}"')
    with pytest.raises(TlsConfigError) as info:
        read_ssl_config(str(path))
    assert str(info.value).startswith(f"{str(path)!r}: server_key is empty: it holds the PEM text itself")


def _encrypted(key_pem: str) -> str:
    key = serialization.load_pem_private_key(key_pem.encode(), password=None)
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    ).decode()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda a, s: TlsSettings("", s.cert), "server_key is empty"),
        (lambda a, s: TlsSettings(s.key, "  \n"), "server_cert is empty"),
        (lambda a, s: TlsSettings(s.key, "/etc/ssl/server.crt"), r"server_cert holds no PEM certificate"),
        (
            lambda a, s: TlsSettings(s.key, "-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n"),
            "server_cert is not PEM certificates",
        ),
        (lambda a, s: TlsSettings(a.server().key, s.cert), "server_key is not the private key of server_cert's first"),
        (lambda a, s: TlsSettings(s.cert, s.cert), "server_key is not a PEM private key"),
        (lambda a, s: TlsSettings(_encrypted(s.key), s.cert), "server_key is encrypted"),
        (lambda a, s: TlsSettings(s.key, s.cert, client_verify=True), "client_verify is true but custom_ca is empty"),
        (lambda a, s: TlsSettings(s.key, s.cert, "ca.pem"), "custom_ca holds no PEM certificate"),
    ],
    ids=[
        "no key",
        "no cert",
        "cert path",
        "cert garbage",
        "key of another",
        "cert as key",
        "encrypted",
        "no ca",
        "ca path",
    ],  # fmt: skip
)
def test_settings_that_cannot_serve_tls_are_refused_naming_the_field(authority, make, message):
    with pytest.raises(TlsConfigError, match=message):
        check(make(authority, authority.server()))


def test_a_chain_with_its_intermediate_and_a_ca_bundle_are_taken(authority):
    server, other = authority.server(), Authority()
    check(TlsSettings(server.key, server.cert + authority.cert, authority.cert + other.cert, True))


def test_without_memory_files_the_pair_is_left_to_grpc(authority, monkeypatch):
    server, other = authority.server(), authority.server()
    monkeypatch.delattr(os, "memfd_create")
    check(TlsSettings(other.key, server.cert))  # no crash: gRPC refuses the pair when it binds
    with pytest.raises(TlsConfigError, match="server_key is empty"):
        check(TlsSettings("", server.cert))  # the checks that need no file still run


def test_the_key_never_reaches_a_file(authority, monkeypatch):
    import tempfile

    def no_files(*args, **kwargs):
        raise AssertionError("the private key went to a file")

    for maker in ("mkdtemp", "mkstemp", "NamedTemporaryFile", "TemporaryDirectory"):
        monkeypatch.setattr(tempfile, maker, no_files)
    server = authority.server()
    with pytest.raises(TlsConfigError, match="is not the private key"):  # the pair is checked all the same
        check(TlsSettings(authority.server().key, server.cert))
    check(TlsSettings(server.key, server.cert))


def test_a_bundle_with_comments_in_any_script_is_taken(authority):
    server = authority.server()
    bundle = f"# Főtanúsítvány, 根证书\n{authority.cert}# 另一个\n{Authority().cert}"
    check(TlsSettings(server.key, server.cert, bundle, True))
    broken = authority.cert.replace("MII", "MIIé", 1)
    with pytest.raises(TlsConfigError, match="custom_ca is not PEM certificates"):
        check(TlsSettings(server.key, server.cert, broken, True))


def test_the_key_is_left_out_of_the_settings_repr(authority):
    server = authority.server()
    assert server.key not in repr(TlsSettings(server.key, server.cert))


def write_pem(folder, pem, ca: str = "") -> tuple[str, str, str]:
    (folder / "tls.crt").write_text(pem.cert)
    (folder / "tls.key").write_text(pem.key)
    if ca:
        (folder / "ca.crt").write_text(ca)
    return str(folder / "tls.crt"), str(folder / "tls.key"), str(folder / "ca.crt") if ca else ""


def test_pem_files_as_a_kubernetes_tls_secret_holds_them(tmp_path, authority):
    server = authority.server()
    cert, key, ca = write_pem(tmp_path, server, authority.cert)
    tls = read_pem_files(cert, key, ca, client_verify=True)
    assert tls == TlsSettings(server.key, server.cert, authority.cert, True)
    assert tls.sources == (cert, key, ca)
    assert read_pem_files(cert, key) == TlsSettings(server.key, server.cert)


def test_pem_files_that_cannot_serve_name_the_flag_and_the_file(tmp_path, authority):
    cert, key, _ = write_pem(tmp_path, authority.server())
    missing = str(tmp_path / "missing.crt")
    with pytest.raises(TlsConfigError) as info:
        read_pem_files(missing, key)
    assert str(info.value) == f"--ssl_server_cert_file: cannot read {missing!r}: No such file or directory"
    other = tmp_path / "other.key"
    other.write_text(authority.server().key)
    with pytest.raises(TlsConfigError) as info:
        read_pem_files(cert, str(other))
    assert str(info.value) == (
        f"--ssl_server_key_file ({str(other)!r}) is not the private key of --ssl_server_cert_file ({cert!r})'s "
        "first certificate"
    )
    with pytest.raises(TlsConfigError, match=r"client_verify is true but --ssl_custom_ca_file \(''\) is empty"):
        read_pem_files(cert, key, client_verify=True)
    (tmp_path / "binary.crt").write_bytes(b"\x30\x82\xff\xfe")  # DER, not PEM
    with pytest.raises(TlsConfigError, match="--ssl_server_cert_file: .* is not PEM text"):
        read_pem_files(str(tmp_path / "binary.crt"), key)
    (tmp_path / "empty.key").write_text("")
    with pytest.raises(TlsConfigError) as info:
        read_pem_files(cert, str(tmp_path / "empty.key"))
    assert str(info.value).endswith("empty.key') is empty")


class TestRotation:
    """Certificates.fetcher(), as gRPC calls it before each TLS handshake of a listener."""

    @pytest.fixture
    def files(self, tmp_path, authority):
        path = tmp_path / "ssl.config"
        path.write_text(ssl_config(authority.server()))
        return path

    @staticmethod
    def rewrite(path, text: str) -> None:
        before = path.stat().st_mtime_ns
        path.write_text(text)
        os.utime(path, ns=(before + 10**9, before + 10**9))  # a later time, whatever the clock's tick

    def test_each_listener_changes_once_to_the_new_certificate(self, files, authority):
        certificates = Certificates(read_ssl_config(str(files)))
        listeners = [certificates.fetcher() for _ in range(3)]
        assert [fetch() for fetch in listeners] == [None, None, None]  # nothing changed
        new = authority.server()
        self.rewrite(files, ssl_config(new))
        changed = [fetch() for fetch in listeners]
        assert all(c is not None for c in changed) and certificates.tls.server_cert == new.cert
        assert [fetch() for fetch in listeners] == [None, None, None]  # each changed once
        late = certificates.fetcher()  # a listener bound after the change starts with it
        assert late() is None

    def test_a_file_touched_but_not_changed_changes_nothing(self, files):
        certificates = Certificates(read_ssl_config(str(files)))
        fetch = certificates.fetcher()
        self.rewrite(files, files.read_text())
        assert fetch() is None

    def test_contents_that_cannot_serve_are_skipped_until_the_next_change(self, files, authority, caplog):
        certificates = Certificates(read_ssl_config(str(files)))
        fetch, before = certificates.fetcher(), certificates.tls
        self.rewrite(files, ssl_config(Pem(authority.server().key, authority.server().cert)))
        assert fetch() is None and certificates.tls is before
        assert "changed and cannot serve: keeping the certificate in use" in caplog.text
        self.rewrite(files, ssl_config(authority.server(), authority.cert, client_verify=True))
        assert fetch() is None and certificates.tls is before
        assert "changed client_verify to True" in caplog.text
        good = authority.server()
        self.rewrite(files, ssl_config(good))
        assert fetch() is not None and certificates.tls.server_cert == good.cert

    def test_a_file_that_cannot_be_read_for_a_moment_is_read_again(self, files, authority, monkeypatch, caplog):
        monkeypatch.setattr("servex.server.transport.tls.RETRY_S", 0.0)
        certificates = Certificates(read_ssl_config(str(files)))
        fetch = certificates.fetcher()
        text = files.read_text()
        files.unlink()  # a Secret being replaced, say
        assert fetch() is None and fetch() is None
        assert caplog.text.count("cannot be read now") == 1  # logged once, not at every retry
        new = authority.server()
        files.write_text(ssl_config(new))
        assert fetch() is not None and certificates.tls.server_cert == new.cert
        assert text != files.read_text()

    def test_an_unexpected_failure_keeps_the_certificate_and_never_reaches_grpc(self, files, monkeypatch, caplog):
        certificates = Certificates(read_ssl_config(str(files)))
        fetch = certificates.fetcher()

        def broken(tls):
            raise RuntimeError("disk on fire")

        monkeypatch.setattr("servex.server.transport.tls._reread", broken)
        self.rewrite(files, files.read_text() + "\n")
        assert fetch() is None
        assert "TLS: checking" in caplog.text and "disk on fire" in caplog.text


def test_not_after_reads_the_expiry_of_the_chain_s_first_certificate(authority):
    import datetime

    soon = datetime.datetime(2031, 5, 17, 8, 30, 5, tzinfo=datetime.UTC)  # UTCTime in the DER
    late = datetime.datetime(2061, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)  # GeneralizedTime (2050 and after)
    first, second = authority.server(not_after=soon), authority.server(not_after=late)
    assert not_after(first.cert) == soon.timestamp()
    assert not_after(second.cert) == late.timestamp()
    assert not_after(first.cert + second.cert) == soon.timestamp()
    assert not_after("no certificate") is None
    assert not_after("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----") is None


def test_rotation_is_counted_and_the_expiry_follows(tmp_path, authority):
    import datetime

    from prometheus_client import REGISTRY

    path = tmp_path / "ssl.config"
    first = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
    path.write_text(ssl_config(authority.server(not_after=first)))
    certificates = Certificates(read_ssl_config(str(path)))
    labels = {"file": str(path)}

    def sample(name, **more):
        return REGISTRY.get_sample_value(name, {**labels, **more})

    assert sample("servex_tls_certificate_expiry_timestamp_seconds") == first.timestamp()
    assert [sample("servex_tls_certificate_reloads_total", outcome=o) for o in ("rotated", "refused")] == [0, 0]
    fetch = certificates.fetcher()
    second = datetime.datetime(2031, 1, 1, tzinfo=datetime.UTC)
    TestRotation.rewrite(path, ssl_config(authority.server(not_after=second)))
    assert fetch() is not None
    assert sample("servex_tls_certificate_expiry_timestamp_seconds") == second.timestamp()
    TestRotation.rewrite(path, ssl_config(Pem(authority.server().key, authority.server().cert)))
    assert fetch() is None
    assert [sample("servex_tls_certificate_reloads_total", outcome=o) for o in ("rotated", "refused")] == [1, 1]
    assert sample("servex_tls_certificate_expiry_timestamp_seconds") == second.timestamp()
