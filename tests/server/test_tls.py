"""server/tls.py: TensorFlow Serving's SSLConfig files read, and every way one cannot serve TLS refused at start
with the field at fault named (gRPC itself would only fail to bind)."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives import serialization

from server.settings import TlsSettings
from server.tls import TlsConfigError, check, read_pem_files, read_ssl_config
from tests.certificates import Authority, ssl_config


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


def test_without_a_writable_temporary_folder_the_pair_is_left_to_grpc(authority, monkeypatch, tmp_path):
    import tempfile

    server, other = authority.server(), authority.server()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    check(TlsSettings(other.key, server.cert))  # no crash: gRPC refuses the pair when it binds
    with pytest.raises(TlsConfigError, match="server_key is empty"):
        check(TlsSettings("", server.cert))  # the checks that need no file still run


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
