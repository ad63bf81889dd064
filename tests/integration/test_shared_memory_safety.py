"""System shared memory against the real daemon when the client misbehaves: memory shrunk after it was
registered (it once killed the daemon with SIGBUS), keys that are symbolic links out of /dev/shm, keys with NUL
bytes or lone surrogates, negative offsets. Each is refused with INVALID_ARGUMENT (400) naming what was wrong, and
the daemon serves the next good request."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.http as httpclient

from tests.support.clients import expect_inference_error as expect_error

SHM = Path("/dev/shm")
X = np.arange(6, dtype=np.float32).reshape(2, 3)


@pytest.fixture(scope="module")
def daemon(start_daemon, sum_model):
    return start_daemon(f"--model_base_path={sum_model}", "--model_name=sum", rest=True)


@pytest.fixture
def files():
    """A fresh tag and the /dev/shm paths made with it, removed after the test."""
    tag = uuid.uuid4().hex[:8]
    made: list[Path] = []

    def path(kind: str) -> Path:
        made.append(SHM / f"servex-{kind}-{tag}")
        return made[-1]

    yield tag, path
    for p in made:
        p.unlink(missing_ok=True)


def client_for(daemon, protocol: str):
    if protocol == "grpc":
        return triton.InferenceServerClient(daemon.address), triton
    return httpclient.InferenceServerClient(f"127.0.0.1:{daemon.rest_port}"), httpclient


def serves(daemon, client, module) -> None:
    """The daemon is alive and answers a good request (data in the request)."""
    assert daemon.proc.poll() is None, f"servex exited with {daemon.proc.returncode}:\n{daemon.log()}"
    x = module.InferInput("x", [2, 3], "FP32")
    x.set_data_from_numpy(X)
    np.testing.assert_array_equal(client.infer("sum", [x]).as_numpy("doubled"), X * 2)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_memory_shrunk_after_registration_is_refused_and_serving_goes_on(daemon, files, protocol):
    tag, path = files
    inputs, outputs = path("in"), path("out")
    inputs.write_bytes(X.tobytes())
    outputs.write_bytes(b"\0" * 64)
    client, module = client_for(daemon, protocol)
    try:
        client.register_system_shared_memory(f"in-{tag}", f"/{inputs.name}", X.nbytes)
        client.register_system_shared_memory(f"out-{tag}", f"/{outputs.name}", 64)
        x = module.InferInput("x", [2, 3], "FP32")
        x.set_shared_memory(f"in-{tag}", X.nbytes)
        doubled = module.InferRequestedOutput("doubled")
        doubled.set_shared_memory(f"out-{tag}", 32, offset=8)
        assert client.infer("sum", [x], outputs=[doubled]).get_output("doubled") is not None
        np.testing.assert_array_equal(np.frombuffer(outputs.read_bytes()[8:32], np.float32), (X * 2).ravel())

        os.truncate(inputs, 0)  # the client shrinks its objects
        os.truncate(outputs, 16)
        expect_error(lambda: client.infer("sum", [x]), protocol, "INVALID_ARGUMENT", 400,
                     f"input 'x': shared memory region 'in-{tag}' is registered as bytes [0, 24) of shared memory "
                     f"'/{inputs.name}', but that memory now holds only 0 bytes")  # fmt: skip
        serves(daemon, client, module)
        sent = module.InferInput("x", [2, 3], "FP32")
        sent.set_data_from_numpy(X)
        expect_error(lambda: client.infer("sum", [sent], outputs=[doubled]), protocol, "INVALID_ARGUMENT", 400,
                     f"output 'doubled': shared memory region 'out-{tag}' is registered as bytes [0, 64) of shared "
                     f"memory '/{outputs.name}', but that memory now holds only 16 bytes")  # fmt: skip
        assert outputs.stat().st_size == 16  # the refused output did not grow the file
        serves(daemon, client, module)

        inputs.write_bytes(X.tobytes())  # grown back: the region works again
        np.testing.assert_array_equal(client.infer("sum", [x]).as_numpy("doubled"), X * 2)
    finally:
        client.unregister_system_shared_memory()
        client.close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_keys_that_are_links_or_not_names_are_refused(daemon, files, protocol, tmp_path):
    tag, path = files
    victim = tmp_path / "victim"  # a file the servex user may write, outside /dev/shm
    victim.write_bytes(b"\1" * 64)
    link = path("link")
    link.symlink_to(victim)
    client, module = client_for(daemon, protocol)
    try:
        expect_error(lambda: client.register_system_shared_memory("r", f"/{link.name}", 16), protocol,
                     "INVALID_ARGUMENT", 400, f"shared memory key '/{link.name}' is a symbolic link")  # fmt: skip
        expect_error(lambda: client.register_system_shared_memory("r", "/a\0b", 4), protocol, "INVALID_ARGUMENT",
                     400, "shared memory key '/a\\x00b' is not a POSIX shared memory name")  # fmt: skip
        assert victim.read_bytes() == b"\1" * 64
        status = client.get_system_shared_memory_status()
        assert (status if protocol == "http" else list(status.regions)) == []
        serves(daemon, client, module)
    finally:
        client.unregister_system_shared_memory()
        client.close()
    assert "Traceback" not in daemon.log()


def test_a_key_with_a_lone_surrogate_is_refused_over_rest(daemon):
    body = b'{"key": "/\\ud800", "byte_size": 4}'  # JSON can spell it; protobuf strings (gRPC) cannot carry it
    url = f"{daemon.rest_url}/v2/systemsharedmemory/region/r-{uuid.uuid4().hex[:8]}/register"
    request = urllib.request.Request(url, data=body)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 400
    error = json.loads(info.value.read())["error"]  # refused by the JSON parser, or else by the registry
    assert "U+D800" in error or "key '/\\ud800' is not a POSIX shared memory name" in error, error


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_negative_offset_is_named_as_such(daemon, files, protocol):
    tag, path = files
    inputs = path("neg")
    inputs.write_bytes(X.tobytes())
    client, module = client_for(daemon, protocol)
    try:
        client.register_system_shared_memory(f"neg-{tag}", f"/{inputs.name}", X.nbytes)
        x = module.InferInput("x", [2, 3], "FP32")
        x.set_shared_memory(f"neg-{tag}", X.nbytes, offset=-8)
        expect_error(lambda: client.infer("sum", [x]), protocol, "INVALID_ARGUMENT", 400,
                     f"input 'x': shared_memory_offset -8 is negative: expected an offset of 0 or more into region "
                     f"'neg-{tag}'")  # fmt: skip
    finally:
        client.unregister_system_shared_memory()
        client.close()
