"""Property tests of server/transport/tls.py's readers: any SSLConfig file (a message of real, broken or foreign
PEM text printed with text_format, then edited at random, or any bytes at all) gives checked TLS settings or a
TlsConfigError naming the file; a certificate's expiry is read from any PEM text or is unknown (None). Never
another exception (tests/support/strategies.py)."""

from __future__ import annotations

import base64

import pytest
from google.protobuf import text_format
from hypothesis import event, example, given
from hypothesis import strategies as st

from servex.protos.servex.v1 import ssl_config_pb2
from servex.server.transport import tls
from tests.certificates import Authority
from tests.support.strategies import examples, mangled

pytestmark = pytest.mark.filterwarnings("ignore:invalid escape sequence:DeprecationWarning")
AUTHORITY = Authority()
SERVER, OTHER = AUTHORITY.server(), AUTHORITY.server()
BLOCK = "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n"
PEMS = st.sampled_from(
    [SERVER.key, SERVER.cert, OTHER.key, AUTHORITY.cert, SERVER.cert + AUTHORITY.cert, "", " \n",
     BLOCK.format("AAAA"), BLOCK.format("é"), BLOCK.format("!!"), SERVER.key.replace("PRIVATE", "ENCRYPTED PRIVATE"),
     SERVER.cert[:200], "/etc/tls/server.key", SERVER.key.replace("BEGIN", "BEGAN")]
)  # fmt: skip
# A NUL after a base64 line of the key: OpenSSL reads the key still, gRPC (a C string) only up to the NUL, and fails
# to bind ("Invalid private key") where the check let it through
NUL_KEY = SERVER.key.replace("\n", "\x00\n", 2).replace("\x00\n", "\n", 1)
CONFIGS = st.builds(
    ssl_config_pb2.SSLConfig,
    server_key=st.just(SERVER.key) | PEMS,  # mostly the pair that serves, to reach the checks past the first
    server_cert=st.sampled_from([SERVER.cert, SERVER.cert + AUTHORITY.cert]) | PEMS,
    custom_ca=st.sampled_from(["", AUTHORITY.cert]) | PEMS,
    client_verify=st.booleans(),
)


@st.composite
def ssl_config_files(draw) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=40))
    text = text_format.MessageToString(draw(CONFIGS))
    return (draw(mangled(text)) if draw(st.integers(0, 2)) == 0 else text).encode("utf-8", "surrogateescape")


@given(ssl_config_files())
@example(text_format.MessageToString(ssl_config_pb2.SSLConfig(server_key=SERVER.key, server_cert=SERVER.cert)).encode())
@example(b"\xff\xfe")
@example(text_format.MessageToString(ssl_config_pb2.SSLConfig(server_key=NUL_KEY, server_cert=SERVER.cert)).encode())
@examples(150)
def test_an_ssl_config_file_gives_checked_settings_or_an_error_naming_it(tmp_path_factory, data):
    path = tmp_path_factory.getbasetemp() / "ssl.config"
    path.write_bytes(data)
    try:
        settings = tls.read_ssl_config(str(path))
    except tls.TlsConfigError as e:
        event("refused")
        assert repr(str(path)) in str(e), str(e)
        return
    event("read")
    config = text_format.Parse(data.decode(), ssl_config_pb2.SSLConfig())
    assert (settings.server_key, settings.server_cert) == (config.server_key, config.server_cert)
    assert settings.server_key in (SERVER.key, OTHER.key) and SERVER.cert in settings.server_cert


def _der_element(tag: int, body: bytes) -> bytes:
    size = len(body)
    length = bytes([size]) if size < 128 else bytes([0x82]) + size.to_bytes(2, "big")
    return bytes([tag]) + length + body


@st.composite
def pem_texts(draw) -> str:
    """A certificate's PEM text: a real one, random DER, or a DER skeleton of a certificate with random dates."""
    kind = draw(st.sampled_from(["real", "random", "skeleton", "skeleton"]))
    if kind == "real":
        return SERVER.cert
    if kind == "random":
        der = draw(st.binary(max_size=64))
    else:
        when = draw(st.sampled_from([b"491231235959Z", b"991231235959Z", b"20491231235959Z", b"99999999999999Z"]))
        tag = draw(st.sampled_from([0x17, 0x18, 0x04]))
        validity = _der_element(0x30, _der_element(0x17, b"250101000000Z") + _der_element(tag, when))
        fields = [_der_element(0x02, b"\x01"), _der_element(0x30, b""), _der_element(0x30, b""), validity]
        tbs = _der_element(0x30, b"".join(fields[: draw(st.sampled_from([4, 4, 4, 3, 2]))]))
        der = _der_element(0x30, tbs)[: draw(st.sampled_from([None, None, None, 5, 12]))]
    return BLOCK.format(base64.b64encode(der).decode())


@given(pem_texts() | st.text(max_size=30))
@examples(200)
def test_a_certificate_s_expiry_is_read_or_unknown(text):
    when = tls.not_after(text)
    event("unknown" if when is None else "read")
    assert when is None or isinstance(when, float)
    if text == SERVER.cert:
        assert when is not None
