"""TensorFlow's profiler service on the gRPC port (``--enable_profiler``, TensorFlow Serving's flag, on by default):
what ``tf.profiler.experimental.client.trace("grpc://host:port", logdir, ms)`` and TensorBoard's Profile tab
("Capture profile") call to record a live server.

``Profile`` records this process with TensorFlow's profiler (``tf.profiler.experimental.start`` / ``stop``, into a
folder of its own) for the request's duration, then writes the XSpace where TensorFlow's own ProfilerServiceImpl
writes it: ``<repository_root>/<session_id>/<host_name>.xplane.pb`` (':' written as '_'), which the client made
``<logdir>/plugins/profile/<run>/``, where TensorBoard looks; with ``emit_xspace`` it is returned instead.
``empty_trace`` says that nothing was recorded (the client then retries, and reports it). The capture waits on the
event loop; TensorFlow's start and stop, and the file I/O, run on a thread of the service's own.

One capture at a time: TensorFlow's profiler is one per process, so a second Profile while one runs is refused
(UNAVAILABLE, naming the running session). ``Terminate`` ends the running capture of that session early (its trace
is kept); ``Monitor`` (a Cloud TPU summary) is not served, as TensorFlow's own server does not serve it.

The trace is written by the server: ``repository_root`` is a path on the server's file system (or any URL
TensorFlow's file systems take, gs:// say), as with TensorFlow Serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import posixpath
import shutil
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import tensorflow as tf
from google.protobuf.message import DecodeError
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from servex.protos.tensorflow import profiler_service_pb2, profiler_service_pb2_grpc

log = logging.getLogger("servex")

SERVICE = profiler_service_pb2.DESCRIPTOR.services_by_name["ProfilerService"].full_name  # tensorflow.ProfilerService
# A capture keeps every event it records in memory until it ends: at most 5 minutes.
MAX_DURATION_MS = 300_000


@dataclass
class _Capture:
    """The running capture: its session and how long it was asked to run; ``terminated`` ends it early."""

    session_id: str
    duration_ms: int
    started: float = field(default_factory=time.monotonic)
    terminated: asyncio.Event = field(default_factory=asyncio.Event)


class ProfilerService(profiler_service_pb2_grpc.ProfilerServiceServicer):
    """``tensorflow.ProfilerService``'s Profile, Terminate and Monitor; one instance per process (the event loop's)."""

    def __init__(self):
        self._capture: _Capture | None = None
        # TensorFlow's start and stop and the file I/O, in order: a cancelled capture's stop runs before the next start
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="servex-profiler")

    async def Profile(self, request, context):
        duration_ms = request.duration_ms or request.opts.duration_ms  # TSL's clients set both; its server reads opts
        problem = request_problem(request, duration_ms)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        running = self._capture
        if running is not None:
            elapsed_ms = (time.monotonic() - running.started) * 1000
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"a profile capture is running (session {running.session_id!r}, {elapsed_ms:.0f} of "
                f"{running.duration_ms} ms): servex records one capture at a time; try again when it ends",
            )
        capture = self._capture = _Capture(request.session_id, duration_ms)
        try:
            return await self._profile(request, capture, context)
        finally:
            self._capture = None

    async def _profile(self, request, capture: _Capture, context):
        loop = asyncio.get_running_loop()
        folder = tempfile.mkdtemp(prefix="servex-profile-")
        try:
            await loop.run_in_executor(self._thread, tf.profiler.experimental.start, folder)
            log.info("profiling for %d ms (session %r)", capture.duration_ms, capture.session_id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(capture.terminated.wait(), capture.duration_ms / 1000)
        except tf.errors.AlreadyExistsError:  # not servex's session: left alone
            await loop.run_in_executor(self._thread, shutil.rmtree, folder, True)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "TensorFlow's profiler is recording already in this process (a profiler session of its own)",
            )
        except BaseException:  # cancelled (the client left, or its deadline passed), even while starting: stop it
            loop.run_in_executor(self._thread, _discard, folder)  # after the start, on the same thread
            raise
        try:
            response, where = await loop.run_in_executor(self._thread, _collect, folder, request)
        except (OSError, DecodeError) as e:  # no XSpace from TensorFlow, one that does not parse, or not written
            log.warning("profile of session %r not saved: %s", capture.session_id, e)
            await context.abort(grpc.StatusCode.INTERNAL, f"the profile was recorded but could not be saved: {e}")
        nothing = " (no events were recorded)" if response.empty_trace else ""
        log.info("profile of session %r: %s%s", capture.session_id, where, nothing)
        return response

    async def Terminate(self, request, context):
        running = self._capture
        if running is not None and running.session_id == request.session_id:
            running.terminated.set()
        return profiler_service_pb2.TerminateResponse()

    async def Monitor(self, request, context):
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "tensorflow.ProfilerService/Monitor is not served by servex (TensorFlow's own profiler server does not "
            "serve it either): Profile and Terminate are, for tf.profiler.experimental.client.trace and "
            "TensorBoard's Profile tab",
        )


def add_to_server(server) -> ProfilerService:
    service = ProfilerService()
    profiler_service_pb2_grpc.add_ProfilerServiceServicer_to_server(service, server)
    return service


def request_problem(request, duration_ms: int) -> str | None:
    """What is wrong with a ProfileRequest, in words, or None."""
    if not 1 <= duration_ms <= MAX_DURATION_MS:
        return (f"ProfileRequest.duration_ms (or opts.duration_ms) must be from 1 to {MAX_DURATION_MS} ms "
                f"({MAX_DURATION_MS // 60000} minutes), got {duration_ms}")  # fmt: skip
    if not request.emit_xspace and not request.repository_root:
        return "ProfileRequest.repository_root is empty: name the folder to write the trace to, or set emit_xspace"
    for name in ("session_id", "host_name"):
        value = getattr(request, name)
        if "/" in value or "\\" in value or value in (".", ".."):
            return f"ProfileRequest.{name} {value!r} must be a file name (no '/', '\\', '.' or '..')"
    return None


def _collect(folder: str, request) -> tuple[profiler_service_pb2.ProfileResponse, str]:
    """Stop TensorFlow's profiler and hand over its XSpace as the request asks; the response and where it went."""
    try:
        tf.profiler.experimental.stop()  # writes <folder>/plugins/profile/<run>/<this host>.xplane.pb
        written = list(Path(folder).glob("plugins/profile/*/*.xplane.pb"))
        if len(written) != 1:
            raise OSError(f"TensorFlow's profiler wrote {len(written)} XSpace files, not 1: {written}")
        data = written[0].read_bytes()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    space = xplane_pb2.XSpace.FromString(data)
    response = profiler_service_pb2.ProfileResponse(empty_trace=_empty(space))
    if request.emit_xspace:
        response.xspace.CopyFrom(space)
        return response, "returned in the response"
    run = request.session_id or time.strftime("%Y_%m_%d_%H_%M_%S")  # TensorFlow's run names
    host = (request.host_name or socket.gethostname()).replace(":", "_")
    path = posixpath.join(request.repository_root, run, f"{host}.xplane.pb")
    try:
        tf.io.gfile.makedirs(posixpath.dirname(path))
        with tf.io.gfile.GFile(path, "wb") as out:
            out.write(data)
    except tf.errors.OpError as e:
        raise OSError(f"{path}: {e.message}") from e
    return response, f"{len(data)} bytes written to {path}"


def _discard(folder: str) -> None:
    try:
        tf.profiler.experimental.stop(save=False)
    except tf.errors.UnavailableError:  # it never started
        pass
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _empty(space) -> bool:
    """Whether no plane of ``space`` holds an event (TSL's IsEmpty): TensorFlow's client reports it, and retries."""
    return not any(line.events for plane in space.planes for line in plane.lines)
