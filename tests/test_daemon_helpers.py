"""The test helpers' own guarantees that the daemon tests rely on."""

from tests.integration.daemon import free_port


def test_free_ports_are_never_handed_out_twice():
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
