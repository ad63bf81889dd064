"""`servex-health`: a gRPC health probe (grpc.health.v1.Health/Check) for container HEALTHCHECKs and scripts.

Exit 0 when the service is SERVING, 1 otherwise (NOT_SERVING, unknown service, nothing listening, timeout), with
one line on stderr saying why. It imports grpc and the health protos only, never TensorFlow, so it answers in a
fraction of a second and can run every few seconds beside a busy server.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


def check(address: str, service: str = "", timeout: float = 3.0, credentials=None, options=()) -> tuple[bool, str]:
    """Ask ``address`` for the health of ``service`` (over TLS with channel ``credentials``); returns (serving, a
    line saying what was seen)."""
    channel = grpc.secure_channel(address, credentials, options) if credentials else grpc.insecure_channel(address)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as error:
            return False, f"{address} service {service!r}: {error.code().name}: {error.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == SERVING, f"{address} service {service!r}: {status}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="servex-health",
        description="Exit 0 when servex's gRPC health service reports SERVING for SERVICE, 1 otherwise.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--address", default="127.0.0.1:8500", help="host:port of servex's gRPC port")
    p.add_argument("--service", default="", help="service name: '' for the whole server, or a model name")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    p.add_argument("--quiet", action="store_true", help="print nothing when SERVING")
    tls = p.add_argument_group("TLS (servex started with --ssl_config_file); any of these turns TLS on")
    tls.add_argument("--tls", action="store_true", help="connect over TLS")
    tls.add_argument(
        "--tls_ca_cert",
        default="",
        help="PEM file of the CA that signed the server's certificate (default: grpcio's bundled roots, or the file "
        "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH names)",
    )
    tls.add_argument("--tls_client_cert", default="", help="PEM file of this client's certificate (client_verify)")
    tls.add_argument("--tls_client_key", default="", help="PEM file of this client's private key (client_verify)")
    tls.add_argument("--tls_server_name", default="", help="name to expect in the server's certificate (default: "
                     "the host of --address)")  # fmt: skip
    return p


def channel_credentials(args: argparse.Namespace):
    """(credentials, channel options) for TLS as the flags ask, (None, ()) for plaintext; OSError for a file that
    cannot be read, ValueError for a client certificate without its key or the other way round."""
    if not (args.tls or args.tls_ca_cert or args.tls_client_cert or args.tls_client_key or args.tls_server_name):
        return None, ()
    if bool(args.tls_client_cert) != bool(args.tls_client_key):
        raise ValueError("--tls_client_cert and --tls_client_key go together")

    def read(path: str) -> bytes | None:
        return Path(path).read_bytes() if path else None

    credentials = grpc.ssl_channel_credentials(
        read(args.tls_ca_cert), read(args.tls_client_key), read(args.tls_client_cert)
    )
    options = (("grpc.ssl_target_name_override", args.tls_server_name),) if args.tls_server_name else ()
    return credentials, options


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.timeout <= 0:
        print(f"servex-health: --timeout must be positive, got {args.timeout}", file=sys.stderr)
        return 2
    try:
        credentials, options = channel_credentials(args)
    except (OSError, ValueError) as e:
        print(f"servex-health: {e}", file=sys.stderr)
        return 2
    serving, line = check(args.address, args.service, args.timeout, credentials, options)
    if not serving or not args.quiet:
        print(line, file=sys.stderr if not serving else sys.stdout)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
