"""`servex-health`: a gRPC health probe (grpc.health.v1.Health/Check) for container HEALTHCHECKs and scripts.

Exit 0 when the service is SERVING, 1 otherwise (NOT_SERVING, unknown service, nothing listening, timeout), with
one line on stderr saying why. It imports grpc and the health protos only, never TensorFlow, so it answers in a
fraction of a second and can run every few seconds beside a busy server.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


def check(address: str, service: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    """Ask ``address`` for the health of ``service``; returns (serving, a line saying what was seen)."""
    with grpc.insecure_channel(address) as channel:
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
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.timeout <= 0:
        print(f"servex-health: --timeout must be positive, got {args.timeout}", file=sys.stderr)
        return 2
    serving, line = check(args.address, args.service, args.timeout)
    if not serving or not args.quiet:
        print(line, file=sys.stderr if not serving else sys.stdout)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
