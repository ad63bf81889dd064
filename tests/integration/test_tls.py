"""TLS on the gRPC ports (TensorFlow Serving's --ssl_config_file) through the real daemon: tensorflow-serving-api
stubs and tritonclient over TLS and mutual TLS, the admin port and the UNIX socket over TLS too, REST left
plaintext, servex-health's TLS flags, and clients that cannot be trusted (plaintext, another CA's server or client
certificate, no client certificate) turned away while everyone else is served. Certificates are made per run by
tests/certificates.py."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import orjson
import pytest
import tritonclient.grpc as triton

from servex.protos.servex.v1 import variables_pb2, variables_pb2_grpc
from tests.certificates import Authority, Pem, ssl_config
from tests.conftest import HALF_PLUS_TWO_TF2
from tests.support.clients import predict_y
from tests.support.daemon import run_to_exit

MODEL = "half"


@pytest.fixture(scope="module")
def authority() -> Authority:
    return Authority()


@pytest.fixture(scope="module")
def ca_file(authority, tmp_path_factory):
    path = tmp_path_factory.mktemp("tls") / "ca.pem"
    path.write_text(authority.cert)
    return path


def start(start_daemon, tmp_path_factory, config: str, credentials, *args: str, rest: bool = False, port_flags=()):
    path = tmp_path_factory.mktemp("tls") / "ssl.config"
    path.write_text(config)
    return start_daemon(f"--model_base_path={HALF_PLUS_TWO_TF2}", f"--model_name={MODEL}",
                        f"--ssl_config_file={path}", *args, rest=rest, credentials=credentials,
                        port_flags=port_flags)  # fmt: skip


@pytest.fixture(scope="module")
def tls_daemon(authority, start_daemon, tmp_path_factory):
    """One-way TLS: the server's certificate, no client certificate asked for; the admin port, a UNIX socket and
    REST on."""
    credentials = grpc.ssl_channel_credentials(authority.cert.encode())
    daemon = start(start_daemon, tmp_path_factory, ssl_config(authority.server()), credentials,
                   f"--grpc_socket_path={tmp_path_factory.mktemp('tls') / 'grpc.sock'}", rest=True,
                   port_flags=["--admin_port"])  # fmt: skip
    return daemon, daemon.admin_port


@pytest.fixture(scope="module")
def mtls_daemon(authority, start_daemon, tmp_path_factory):
    """Mutual TLS: client_verify with the test CA as custom_ca."""
    client = authority.client()
    credentials = grpc.ssl_channel_credentials(authority.cert.encode(), client.key.encode(), client.cert.encode())
    config = ssl_config(authority.server(), authority.cert, client_verify=True)
    return start(start_daemon, tmp_path_factory, config, credentials), client


VALUES = (1.0, 2.0, 5.0)


def refused(channel) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        predict_y(channel, MODEL, VALUES, timeout=10)
    channel.close()
    return info.value


def test_predict_over_tls(tls_daemon):
    daemon, _ = tls_daemon
    assert predict_y(daemon.channel, MODEL, VALUES) == [2.5, 3.0, 4.5]
    assert "TLS" in daemon.log().split("gRPC on ", 1)[1].splitlines()[0]


def test_plaintext_and_a_server_certificate_of_another_ca_are_turned_away(tls_daemon):
    daemon, _ = tls_daemon
    error = refused(grpc.insecure_channel(daemon.address))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    error = refused(grpc.secure_channel(daemon.address, grpc.ssl_channel_credentials(Authority().cert.encode())))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "certificate" in error.details().lower()
    assert predict_y(daemon.channel, MODEL, (4.0,)) == [4.0]  # everyone else is still served
    assert daemon.proc.poll() is None
    assert "Handshake failed" not in daemon.log()  # a client cannot fill servex's log with failed handshakes


def test_a_certificate_for_another_name_is_turned_away(tls_daemon, authority):
    daemon, _ = tls_daemon
    options = (("grpc.ssl_target_name_override", "other.example"),)
    credentials = grpc.ssl_channel_credentials(authority.cert.encode())
    error = refused(grpc.secure_channel(daemon.address, credentials, options))
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "Hostname Verification" in error.details()


def test_the_admin_port_serves_tls_too(tls_daemon, authority):
    _, admin = tls_daemon
    address = f"127.0.0.1:{admin}"
    request = variables_pb2.ListVariablesRequest()
    request.model.name = MODEL
    with grpc.secure_channel(address, grpc.ssl_channel_credentials(authority.cert.encode())) as channel:
        reply = variables_pb2_grpc.VariableServiceStub(channel).ListVariables(request, timeout=10)
    assert reply.variables  # half_plus_two's a and b
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as info:
        variables_pb2_grpc.VariableServiceStub(channel).ListVariables(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_unix_socket_serves_tls_too(tls_daemon, authority):
    daemon, _ = tls_daemon
    target = "unix:" + daemon.log().split(" and unix:", 1)[1].split(" ", 1)[0]
    # a unix: target has no host name to check: the client names the one the server's certificate holds
    options = (("grpc.ssl_target_name_override", "localhost"),)
    with grpc.secure_channel(target, grpc.ssl_channel_credentials(authority.cert.encode()), options) as channel:
        assert predict_y(channel, MODEL, (6.0,)) == [5.0]
    assert refused(grpc.insecure_channel(target)).code() == grpc.StatusCode.UNAVAILABLE


def test_rest_stays_plaintext_as_in_tensorflow_serving(tls_daemon):
    daemon, _ = tls_daemon
    body = urllib.request.urlopen(f"{daemon.rest_url}/v1/models/{MODEL}", timeout=10).read()
    assert orjson.loads(body)["model_version_status"][0]["state"] == "AVAILABLE"


def health(daemon, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "servex.server.healthcheck", f"--address={daemon.address}", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=30)


def test_servex_health_speaks_tls_with_its_flags(tls_daemon, ca_file, tmp_path):
    daemon, _ = tls_daemon
    probe = health(daemon, f"--tls_ca_cert={ca_file}")
    assert probe.returncode == 0 and "SERVING" in probe.stdout
    probe = health(daemon)
    assert probe.returncode == 1 and "UNAVAILABLE" in probe.stderr
    probe = health(daemon, f"--tls_ca_cert={ca_file}", "--tls_server_name=other.example")
    assert probe.returncode == 1 and "Hostname Verification" in probe.stderr
    probe = health(daemon, f"--tls_ca_cert={tmp_path / 'missing.pem'}")
    assert probe.returncode == 2 and "missing.pem" in probe.stderr
    probe = health(daemon, f"--tls_ca_cert={ca_file}", f"--tls_client_cert={ca_file}")
    assert probe.returncode == 2 and "--tls_client_cert and --tls_client_key go together" in probe.stderr


def test_mutual_tls_serves_a_client_certificate_the_ca_signed(mtls_daemon):
    daemon, _ = mtls_daemon
    assert predict_y(daemon.channel, MODEL, VALUES) == [2.5, 3.0, 4.5]
    assert "client certificates required" in daemon.log()


def test_mutual_tls_turns_away_no_client_certificate_or_one_of_another_ca(mtls_daemon, authority):
    daemon, _ = mtls_daemon
    error = refused(grpc.secure_channel(daemon.address, grpc.ssl_channel_credentials(authority.cert.encode())))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    stranger = Authority().client()
    credentials = grpc.ssl_channel_credentials(authority.cert.encode(), stranger.key.encode(), stranger.cert.encode())
    assert refused(grpc.secure_channel(daemon.address, credentials)).code() == grpc.StatusCode.UNAVAILABLE
    assert predict_y(daemon.channel, MODEL, (0.0,)) == [2.0]


def test_tritonclient_over_mutual_tls(mtls_daemon, authority, ca_file, tmp_path):
    daemon, client_pem = mtls_daemon
    (tmp_path / "client.key").write_text(client_pem.key)
    (tmp_path / "client.pem").write_text(client_pem.cert)
    with triton.InferenceServerClient(daemon.address, ssl=True, root_certificates=str(ca_file),
                                      private_key=str(tmp_path / "client.key"),
                                      certificate_chain=str(tmp_path / "client.pem")) as client:  # fmt: skip
        assert client.is_server_live()
        x = triton.InferInput("x", [2], "FP32")
        x.set_data_from_numpy(np.array([2.0, -2.0], np.float32))
        result = client.infer(MODEL, [x])
    assert list(result.as_numpy("y")) == [3.0, 1.0]


def test_an_ssl_config_that_cannot_serve_stops_servex_at_start_naming_the_field(authority, tmp_path):
    path = tmp_path / "ssl.config"
    path.write_text(ssl_config(Pem(authority.server().key, authority.server().cert)))
    outcome = run_to_exit([f"--ssl_config_file={path}"])
    assert outcome.returncode == 2
    assert "--ssl_config_file:" in outcome.stderr
    assert "server_key is not the private key of server_cert's first certificate" in outcome.stderr


def wait_for_log(daemon, text: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while text not in daemon.log():
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{daemon.log()[-2000:]}"
        time.sleep(0.05)


def fresh_channel(address: str, ca: str, key: str | None = None, cert: str | None = None):
    """A channel on a connection of its own (a new TLS handshake), trusting ``ca``, with a client certificate
    where ``key`` and ``cert`` are given."""
    credentials = grpc.ssl_channel_credentials(ca.encode(), key and key.encode(), cert and cert.encode())
    return grpc.secure_channel(address, credentials, (("grpc.use_local_subchannel_pool", 1),))


def served_certificate(port: int) -> bytes:
    """The certificate servex presents now, on a new connection (DER)."""
    return ssl.PEM_cert_to_DER_cert(ssl.get_server_certificate(("127.0.0.1", port), timeout=10))


def der(pem: str) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem)


def test_a_rotated_certificate_serves_new_connections_without_a_restart(start_daemon, tmp_path_factory):
    old, new = Authority("old CA"), Authority("new CA")
    old_server, new_server = old.server(), new.server()
    daemon = start(start_daemon, tmp_path_factory, ssl_config(old_server),
                   grpc.ssl_channel_credentials(old.cert.encode()))  # fmt: skip
    config = _config_path(daemon)
    assert predict_y(daemon.channel, MODEL, VALUES) == [2.5, 3.0, 4.5]  # a connection made under the old certificate
    assert served_certificate(daemon.port) == der(old_server.cert)
    config.write_text(ssl_config(new_server))
    with fresh_channel(daemon.address, new.cert) as channel:
        assert predict_y(channel, MODEL, (2.0,)) == [3.0]
    wait_for_log(daemon, f"TLS: {config} changed: new connections get its certificate")
    assert refused(fresh_channel(daemon.address, old.cert)).code() == grpc.StatusCode.UNAVAILABLE
    assert predict_y(daemon.channel, MODEL, (4.0,)) == [4.0]  # the open connection keeps its session
    for attempt in range(8):  # new connections, spread by the kernel over the listeners
        assert served_certificate(daemon.port) == der(new_server.cert), attempt


def test_a_changed_file_that_cannot_serve_keeps_the_certificate_in_use(start_daemon, tmp_path_factory, authority):
    server = authority.server()
    daemon = start(start_daemon, tmp_path_factory, ssl_config(server),
                   grpc.ssl_channel_credentials(authority.cert.encode()))  # fmt: skip
    config = _config_path(daemon)
    config.write_text(ssl_config(Pem(Authority().server().key, authority.server().cert)))
    assert served_certificate(daemon.port) == der(server.cert)  # not the new file's certificate
    wait_for_log(daemon, f"TLS: {config} changed and cannot serve: keeping the certificate in use: {str(config)!r}: "
                         "server_key is not the private key")  # fmt: skip
    other = authority.server()
    config.write_text(ssl_config(other, authority.cert, client_verify=True))
    with fresh_channel(daemon.address, authority.cert) as channel:
        assert predict_y(channel, MODEL, (0.0,)) == [2.0]  # still no client certificate asked for
    wait_for_log(daemon, "changed client_verify to True: keeping the certificate in use")
    assert served_certificate(daemon.port) == der(server.cert)
    assert daemon.proc.poll() is None


def secret_volume(folder: Path, version: str, server: Pem, ca: str) -> None:
    """Write a Kubernetes TLS Secret's files as the kubelet does: into a fresh folder, then one atomic swap of the
    ``..data`` link that tls.crt, tls.key and ca.crt point through."""
    data = folder / f"..{version}"
    data.mkdir()
    for name, text in (("tls.crt", server.cert), ("tls.key", server.key), ("ca.crt", ca)):
        (data / name).write_text(text)
        if not (folder / name).is_symlink():
            (folder / name).symlink_to(Path("..data") / name)
    (folder / "..data_tmp").symlink_to(data.name)
    os.replace(folder / "..data_tmp", folder / "..data")


def test_pem_files_of_a_kubernetes_secret_serve_mutual_tls_and_rotate(start_daemon, tmp_path_factory):
    old, new = Authority("old CA"), Authority("new CA")
    folder = tmp_path_factory.mktemp("secret")
    secret_volume(folder, "v1", old.server(), old.cert)
    client = old.client()
    credentials = grpc.ssl_channel_credentials(old.cert.encode(), client.key.encode(), client.cert.encode())
    daemon = start_daemon(f"--model_base_path={HALF_PLUS_TWO_TF2}", f"--model_name={MODEL}",
                          f"--ssl_server_cert_file={folder / 'tls.crt'}", f"--ssl_server_key_file={folder / 'tls.key'}",
                          f"--ssl_custom_ca_file={folder / 'ca.crt'}", "--ssl_client_verify",
                          credentials=credentials)  # fmt: skip
    assert predict_y(daemon.channel, MODEL, VALUES) == [2.5, 3.0, 4.5]
    no_client_cert = grpc.ssl_channel_credentials(old.cert.encode())
    assert refused(grpc.secure_channel(daemon.address, no_client_cert)).code() == grpc.StatusCode.UNAVAILABLE
    secret_volume(folder, "v2", new.server(), new.cert)  # cert-manager renewed: a new CA, key and certificate
    new_client = new.client()
    with fresh_channel(daemon.address, new.cert, new_client.key, new_client.cert) as channel:
        assert predict_y(channel, MODEL, (2.0,)) == [3.0]
    wait_for_log(daemon, "changed: new connections get its certificate")
    # a client of the old CA is now turned away: servex's certificate is the new CA's
    assert refused(fresh_channel(daemon.address, old.cert, client.key, client.cert)).code() == (
        grpc.StatusCode.UNAVAILABLE
    )
    # and so is the old client certificate, trusting the new server: custom_ca is the new CA now
    assert refused(fresh_channel(daemon.address, new.cert, client.key, client.cert)).code() == (
        grpc.StatusCode.UNAVAILABLE
    )


def _config_path(daemon) -> Path:
    flag = next(arg for arg in daemon.args if arg.startswith("--ssl_config_file="))  # (its flags, as it was given)
    return Path(flag.split("=", 1)[1])
