"""Triton's system shared memory extension against the real daemon, with tritonclient's own shared memory
utilities (POSIX shared memory in /dev/shm): regions registered, listed and unregistered over gRPC and REST;
inputs read from a region, outputs written into one; bad regions, keys and sizes answered with errors that name
them, and serving going on."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.support.clients import expect_inference_error as expect_error

X = np.arange(6, dtype=np.float32).reshape(2, 3)


@pytest.fixture(scope="module")
def daemon(start_daemon, sum_model):
    return start_daemon(f"--model_base_path={sum_model}", "--model_name=sum", rest=True)


@pytest.fixture
def regions():
    """Two fresh regions' handles (input: X at offset 16, output: 64 bytes), destroyed after the test."""
    tag = uuid.uuid4().hex[:8]
    inputs = shm.create_shared_memory_region(f"in-{tag}", f"/servex-in-{tag}", 16 + X.nbytes)
    shm.set_shared_memory_region(inputs, [X], offset=16)
    outputs = shm.create_shared_memory_region(f"out-{tag}", f"/servex-out-{tag}", 64)
    yield tag, inputs, outputs
    shm.destroy_shared_memory_region(inputs)
    shm.destroy_shared_memory_region(outputs)


def clients(daemon):
    return [("grpc", triton.InferenceServerClient(daemon.address), triton),
            ("http", httpclient.InferenceServerClient(f"127.0.0.1:{daemon.rest_port}"), httpclient)]  # fmt: skip


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_inputs_read_from_and_outputs_written_into_registered_regions(daemon, regions, protocol):
    tag, inputs, outputs = regions
    _, client, module = next(c for c in clients(daemon) if c[0] == protocol)
    try:
        client.register_system_shared_memory(f"in-{tag}", f"/servex-in-{tag}", 16 + X.nbytes)
        client.register_system_shared_memory(f"out-{tag}", f"/servex-out-{tag}", 64)
        x = module.InferInput("x", [2, 3], "FP32")
        x.set_shared_memory(f"in-{tag}", X.nbytes, offset=16)
        doubled = module.InferRequestedOutput("doubled")
        doubled.set_shared_memory(f"out-{tag}", 32, offset=8)
        result = client.infer("sum", [x], outputs=[doubled, module.InferRequestedOutput("total")])
        assert result.as_numpy("total") == pytest.approx(X.sum())  # answered in the response as usual
        answer = result.get_output("doubled")  # its data is in the region, not the response
        if protocol == "http":
            assert answer["shape"] == [2, 3] and "data" not in answer
            assert answer["parameters"]["shared_memory_region"] == f"out-{tag}"
        else:
            assert list(answer.shape) == [2, 3] and not answer.contents.ListFields()
            assert answer.parameters["shared_memory_region"].string_param == f"out-{tag}"
        np.testing.assert_array_equal(shm.get_contents_as_numpy(outputs, np.float32, [2, 3], offset=8), X * 2)

        status = client.get_system_shared_memory_status()
        listed = status if protocol == "http" else triton_regions(status)
        assert {(r["name"], r["key"], int(r["byte_size"])) for r in listed} >= {
            (f"in-{tag}", f"/servex-in-{tag}", 16 + X.nbytes), (f"out-{tag}", f"/servex-out-{tag}", 64)}  # fmt: skip
        client.unregister_system_shared_memory(f"in-{tag}")
        with pytest.raises(InferenceServerException, match=f"region 'in-{tag}' is not registered"):
            client.infer("sum", [x])
        client.unregister_system_shared_memory()  # every region
        listed = client.get_system_shared_memory_status()
        assert (listed if protocol == "http" else triton_regions(listed)) == []
    finally:
        client.close()


def triton_regions(status) -> list[dict]:
    return [{"name": r.name, "key": r.key, "byte_size": r.byte_size} for r in status.regions.values()]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_bad_regions_keys_and_sizes_are_refused_naming_them(daemon, regions, protocol):
    tag, inputs, outputs = regions
    _, client, module = next(c for c in clients(daemon) if c[0] == protocol)
    name = f"in-{tag}"
    try:
        cases = [
            (lambda: client.register_system_shared_memory("r", "/servex-missing", 8), "INVALID_ARGUMENT", 400,
             "shared memory key '/servex-missing' does not exist"),
            (lambda: client.register_system_shared_memory("r", "/../etc/passwd", 8), "INVALID_ARGUMENT", 400,
             "is not a POSIX shared memory name"),
            (lambda: client.register_system_shared_memory("r", f"/servex-in-{tag}", 4096), "INVALID_ARGUMENT", 400,
             "runs past the end of shared memory"),
        ]  # fmt: skip
        for call, status, http_status, words in cases:
            expect_error(call, protocol, status, http_status, words)
        client.register_system_shared_memory(name, f"/servex-in-{tag}", 16 + X.nbytes)
        expect_error(lambda: client.register_system_shared_memory(name, f"/servex-in-{tag}", 8), protocol,
                     "ALREADY_EXISTS", 409, f"region {name!r} is already registered")  # fmt: skip
        x = module.InferInput("x", [2, 3], "FP32")
        x.set_shared_memory(name, X.nbytes, offset=32)  # 16 + 24 + 32 > 40
        expect_error(
            lambda: client.infer("sum", [x]),
            protocol,
            "INVALID_ARGUMENT",
            400,
            f"input 'x': shared_memory_offset 32 + shared_memory_byte_size 24 runs past region {name!r}",
        )
        x.set_shared_memory(name, X.nbytes, offset=16)
        small = module.InferRequestedOutput("doubled")
        small.set_shared_memory(name, 8)
        expect_error(
            lambda: client.infer("sum", [x], outputs=[small]),
            protocol,
            "INVALID_ARGUMENT",
            400,
            "output 'doubled' takes 24 bytes, more than the 8 of shared memory given to it",
        )
        handle = b"aGFuZGxl" if protocol == "grpc" else "aGFuZGxl"  # base64, as each client takes it
        expect_error(lambda: client.register_cuda_shared_memory("c", handle, 0, 8), protocol, "UNIMPLEMENTED",
                     501, "CUDA shared memory is not supported")  # fmt: skip
        np.testing.assert_array_equal(client.infer("sum", [x]).as_numpy("doubled"), X * 2)  # serving goes on
    finally:
        client.unregister_system_shared_memory()
        client.close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_cuda_shared_memory_status_and_unregister_answer_as_a_triton_without_gpus(daemon, regions, protocol):
    # Triton's simple_{grpc,http}_shm_client.py call unregister_cuda_shared_memory() before they start: nothing is
    # registered (registering is UNIMPLEMENTED), so there is nothing to unregister, and no region to list
    tag, _, _ = regions
    _, client, _ = next(c for c in clients(daemon) if c[0] == protocol)
    try:
        client.register_system_shared_memory(f"in-{tag}", f"/servex-in-{tag}", 16 + X.nbytes)
        client.unregister_cuda_shared_memory()
        client.unregister_cuda_shared_memory("c")
        client.unregister_cuda_shared_memory(f"in-{tag}")  # a system region is not a CUDA one: it stays
        status = client.get_cuda_shared_memory_status()
        assert (status if protocol == "http" else list(status.regions)) == []
        expect_error(lambda: client.get_cuda_shared_memory_status("c"), protocol, "NOT_FOUND", 404,
                     "Unable to find cuda shared memory region: 'c'")  # fmt: skip
        words = f"The region named 'in-{tag}' is registered as system shared memory, not CUDA shared memory"
        expect_error(lambda: client.get_cuda_shared_memory_status(f"in-{tag}"), protocol, "NOT_FOUND", 404, words)
        listed = client.get_system_shared_memory_status()
        assert [r["name"] for r in (listed if protocol == "http" else triton_regions(listed))] == [f"in-{tag}"]
    finally:
        client.unregister_system_shared_memory()
        client.close()
