"""servex on the model suite (scripts/suite_models.py), side by side with in-process TensorFlow and its peers.

    python scripts/bench_suite.py [--seconds 5] [--rounds 1] [--models resnet50,mlp] [--concurrency 1,8,32]
        [--servers inprocess,servex,kserve,mlserver] [--models_dir /tmp/suite] [--docs docs] [--servex_flag=--X]

For each round and model, one after another: ``inprocess``: ``signatures["serving_default"]`` of
``tf.saved_model.load`` in a fresh process of servex's venv, TensorFlow's default threading, called with
``tf.constant`` inputs (only the call timed): the mean batch-1 latency, and the limit, the best rows/s over batches
of 1..32 (each batch size's median over ``PASSES`` passes, the sizes in turns: the host's slow and fast phases last
seconds, and the best of single passes picked the luckiest, up to 16% above the next run's). ``servex`` (default
flags, plus any ``--servex_flag``), ``kserve``, ``mlserver`` (the kit's peers, as scripts/bench_peers.py starts
them): KServe v2 gRPC ModelInfer, one row of every input per request, closed-loop through the kit's h2load driver at
each concurrency (rows/s, mean latency), then h2load's per-request log (p50/p99); a level runs --seconds, or longer
where a slow model needs it for ~8 requests per caller; then 1 caller through grpcio's client too (through h2load,
some large requests wait 40 ms unread: docs/performance.md). ModelInfer is checked (it answers the output) before
and after the load, so errors are not counted as throughput; a server that fails is recorded and skipped.
``wide_deep_classify`` (with wide_deep): servex's TensorFlow Serving Classify, one serialized tf.Example per
request, through h2load too (then 1 caller through grpcio's client), against in-process ``classify`` calls.
Prints one JSON line per measurement, then each model's ratios against the goals (medians over rounds), and
writes DOCS/performance-suite.md and DOCS/img/suite.png (matplotlib). --models: the suite by default; also other
architectures (suite_models.MORE: efficientnet_b0, densenet121, gru) to check the defaults on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402

from scripts.bench_peers import KIT, METHOD, free_port, h2load_percentiles, h2load_run  # noqa: E402  (h2grpc's)
from scripts.suite_models import MODELS, SUITE, WIDE_DEEP_IDS, WIDE_DEEP_ROWS, export  # noqa: E402
from scripts.suite_report import GOALS, chart, markdown, summarize, verdict  # noqa: E402

PY = REPO / ".venv" / "bin" / "python"
DTYPES = {"FP32": np.float32, "INT32": np.int32, "INT64": np.int64}
BATCHES = (1, 2, 4, 8, 16, 32)
PASSES = 3
CLASSIFY = "wide_deep_classify"
CLASSIFY_METHOD = "/tensorflow.serving.PredictionService/Classify"


def rows(inp, batch: int, rng) -> np.ndarray:
    """``batch`` rows of one Input, values in [0, high)."""
    shape = (batch, *inp.row)
    if inp.dtype == "FP32":
        return (rng.random(shape) * inp.high).astype(np.float32)
    return rng.integers(0, inp.high, shape, dtype=DTYPES[inp.dtype])


def fill_example(example, rng):
    """A wide_deep tf.Example: features ``dense`` (13 floats) and ``ids`` (8 int64)."""
    example.features.feature["dense"].float_list.value.extend(rng.random(13).tolist())
    example.features.feature["ids"].int64_list.value.extend(rng.integers(0, WIDE_DEEP_ROWS, WIDE_DEEP_IDS).tolist())
    return example


def inprocess_child(spec: dict) -> None:
    """Runs in a fresh process: prints the batch-1 latency and the limit over batch sizes as one JSON line."""
    import tensorflow as tf

    fn = tf.saved_model.load(spec["path"]).signatures[spec["signature"]]
    rng, seconds = np.random.default_rng(0), spec["seconds"]
    if spec["signature"] == "classify":
        example = fill_example(tf.train.Example(), rng).SerializeToString()
        feeds = lambda b: {"inputs": tf.constant([example] * b)}  # noqa: E731
    else:
        feeds = lambda b: {i.name: tf.constant(rows(i, b, rng)) for i in MODELS[spec["model"]].inputs}  # noqa: E731

    def timed(feed: dict, budget: float) -> list[float]:
        fn(**feed)  # warm: the first call at a shape builds its kernels
        times: list[float] = []
        while sum(times) < budget or len(times) < 3:
            t0 = time.perf_counter()
            fn(**feed)
            times.append(time.perf_counter() - t0)
        return times

    latency = timed(feeds(1), seconds)
    passes: dict[int, list[float]] = {b: [] for b in BATCHES}
    for _ in range(PASSES):
        for b in BATCHES:
            times = timed(feeds(b), max(1.0, seconds / 2) / PASSES)
            passes[b].append(b * len(times) / sum(times))
    by_batch = {b: round(statistics.median(rates), 1) for b, rates in passes.items()}
    best = max(by_batch, key=by_batch.get)
    print(json.dumps({"latency_ms": round(1000 * statistics.mean(latency), 3), "calls": len(latency),
                      "limit_rows_s": by_batch[best], "limit_batch": best, "by_batch": by_batch}))  # fmt: skip


def inprocess(model: str, base: Path, signature: str, seconds: int) -> dict:
    spec = {"model": model, "path": str(base / "1"), "signature": signature, "seconds": seconds}
    child = [str(PY), str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    out = subprocess.run(child, capture_output=True, text=True)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def command(server: str, model: str, base: Path, port: int, a) -> list[str]:
    if server == "servex":
        return [str(PY), "-m", "servex.server", f"--model_name={model}", f"--model_base_path={base}", f"--port={port}",
                "--rest_api_port=0", "--metrics_port=0", "--bind_address=127.0.0.1", *a.servex_flag]  # fmt: skip
    if server == "kserve":
        python = Path(a.peers_dir) / "kserve" / "bin" / "python"
        return [str(python), str(KIT / "peers" / "kserve_tf.py"), model, str(base / "1"), str(port), str(free_port())]
    return ["bash", str(KIT / "peers" / "run_mlserver.sh"), model, str(base / "1"), str(port), str(free_port()),
            "32", "0.002"]  # fmt: skip


def infer_request(model: str, batch: int = 1) -> service_pb2.ModelInferRequest:
    """``batch`` rows (one by default) of every input of ``model``, as raw_input_contents."""
    rng = np.random.default_rng(0)
    request = service_pb2.ModelInferRequest(model_name=model)
    for inp in MODELS[model].inputs:
        request.inputs.add(name=inp.name, datatype=inp.dtype, shape=[batch, *inp.row])
        request.raw_input_contents.append(rows(inp, batch, rng).tobytes())  # in the inputs' order
    return request


def wait_ready(port: int, proc: subprocess.Popen, model: str, timeout: float = 600) -> None:
    """Until the v2 ModelReady RPC says the model is ready."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"exited with {proc.returncode} before it was ready")
            try:
                if stub.ModelReady(service_pb2.ModelReadyRequest(name=model), timeout=5).ready:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"not ready within {timeout:.0f}s")


def check_infer(port: int, request, output: str, calls: int = 3) -> None:
    """``calls`` ModelInfer calls (warming the server up) that must answer ``output`` for the one row."""
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 1 << 30)]) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        for _ in range(calls):
            try:
                response = stub.ModelInfer(request, timeout=120)
            except grpc.RpcError as e:
                raise RuntimeError(f"ModelInfer failed: {e.code().name}: {e.details()}") from None
            found = [o for o in response.outputs if o.name == output]
            if not found or found[0].shape[:1] != [1] or not (response.raw_output_contents or found[0].contents):
                raise RuntimeError(f"ModelInfer answered no {output!r} row: {[o.name for o in response.outputs]}")


def h2load_level(port: int, frame: Path, c: int, seconds: int, method: str = METHOD) -> dict:
    """rows/s and mean latency from the kit's h2load driver, then p50/p99 from h2load's per-request log."""
    r = h2load_run(port, str(frame), c, seconds, method)
    if r["rps"] is None:
        raise RuntimeError(f"h2load gave no figures at {c} callers")
    tail = h2load_percentiles(port, frame, c, seconds, method)
    return {"concurrency": c, "rows_s": r["rps"], "mean_ms": r["mean_ms"], "p50_ms": tail["p50_ms"],
            "p99_ms": tail["p99_ms"], "failed": r["failed"]}  # fmt: skip


async def aio_level(port: int, method: str, payload: bytes, c: int, seconds: float, warm: float = 1.0) -> dict:
    """A closed loop of ``c`` grpc.aio callers of ``method`` (a serialized request), one request in flight each (as
    the kit's loadgen)."""
    latencies, errors = [], []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", -1)]) as ch:
        call = ch.unary_unary(method)  # bytes in, bytes out
        stop = (start := time.perf_counter() + warm) + seconds

        async def caller():
            while (t0 := time.perf_counter()) < stop:
                try:
                    await call(payload, timeout=30)
                except grpc.aio.AioRpcError as e:
                    errors.append(e.code().name)
                    continue
                if t0 >= start:
                    latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(caller() for _ in range(c)))
    ms = np.array(latencies or [float("nan")]) * 1000
    return {"concurrency": c, "rows_s": round(len(latencies) / seconds, 1), "mean_ms": round(float(ms.mean()), 3),
            "p50_ms": round(float(np.percentile(ms, 50)), 3), "p99_ms": round(float(np.percentile(ms, 99)), 3),
            "failed": len(errors), "first_error": errors[0] if errors else None}  # fmt: skip


def frame_file(path: Path, payload: bytes) -> Path:
    """``payload`` as a gRPC message frame in ``path``, for h2load."""
    path.write_bytes(b"\0" + struct.pack(">I", len(payload)) + payload)
    return path


def classify_levels(port: int, levels: list[int], seconds: int, emit, work: Path) -> dict:
    """servex's Classify on wide_deep's ``classify`` signature, one example per request: through h2load as the
    other models, then 1 caller through grpcio's client."""
    from tensorflow_serving.apis import classification_pb2, prediction_service_pb2_grpc

    request = classification_pb2.ClassificationRequest()
    request.model_spec.name, request.model_spec.signature_name = "wide_deep", "classify"
    fill_example(request.input.example_list.examples.add(), np.random.default_rng(0))

    def check(calls: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            for _ in range(calls):
                answer = stub.Classify(request, timeout=120)
                if len(answer.result.classifications) != 1 or not answer.result.classifications[0].classes:
                    raise RuntimeError(f"Classify answered no class scores: {answer}")

    check(3)
    payload = request.SerializeToString()
    frame = frame_file(work / f"{CLASSIFY}.grpc", payload)
    out = {c: emit({**h2load_level(port, frame, c, seconds, CLASSIFY_METHOD), "seconds": seconds}) for c in levels}
    one = emit({**asyncio.run(aio_level(port, CLASSIFY_METHOD, payload, levels[0], seconds)), "client": "grpcio"})
    check(1)  # still answering after the load
    return {"levels": out, "grpc_one_ms": None if one["failed"] else one["mean_ms"]}


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
            return


def serve(server: str, model: str, base: Path, a, levels: list[int], emit, work: Path) -> dict[str, dict]:
    """One server on one model: {model: result} (servex on wide_deep adds wide_deep_classify)."""
    port, request = free_port(), infer_request(model)
    payload = request.SerializeToString()
    frame = frame_file(work / f"{model}.grpc", payload)
    log, proc, results, t0 = open(work / f"{server}-{model}.log", "wb"), None, {}, time.monotonic()
    try:
        proc = subprocess.Popen(command(server, model, base, port, a), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PEERS_DIR=a.peers_dir), start_new_session=True)  # fmt: skip
        wait_ready(port, proc, model)
        check_infer(port, request, MODELS[model].output)
        emit({"event": "ready", "seconds": round(time.monotonic() - t0, 1)}, model=model)
        levels_out, rate = {}, None
        for c in levels:  # long enough for each caller to finish ~8 requests at the rate of the first level
            seconds = max(a.seconds, math.ceil(8 * c / rate)) if rate else a.seconds
            levels_out[c] = emit({**h2load_level(port, frame, c, seconds), "seconds": seconds}, model=model)
            rate = rate or levels_out[c]["rows_s"]
        one = asyncio.run(aio_level(port, METHOD, payload, levels[0], a.seconds))  # 1 caller through grpcio's client
        emit({**one, "client": "grpcio"}, model=model)
        check_infer(port, request, MODELS[model].output, calls=1)  # still answering after the load
        results[model] = {"levels": levels_out, "grpc_one_ms": None if one["failed"] else one["mean_ms"]}
        if server == "servex" and model == "wide_deep":
            try:
                results[CLASSIFY] = classify_levels(port, levels, a.seconds, lambda r: emit(r, model=CLASSIFY), work)
            except Exception as e:
                results[CLASSIFY] = {"error": str(e)[:300]}
    except Exception as e:
        tail = Path(log.name).read_text(errors="replace").strip().splitlines()[-1:]
        results[model] = {"error": "; ".join([str(e)[:300], *(line[:300] for line in tail)]), "log": log.name}
    finally:
        log.close()
        if proc is not None:
            stop(proc)
    return {name: emit(r, model=name) if "error" in r else r for name, r in results.items()}


def wait_quiet(emit, limit: int = 900) -> None:
    """Until no other servex daemon or test run is on the machine (on a small machine they skew the figures)."""
    for waited in range(0, limit, 5):
        if not subprocess.run(["pgrep", "-f", "--", "-m server |pytest"], capture_output=True).stdout:
            return
        if not waited:
            emit({"event": "waiting for other servex daemons or test runs to end"})
        time.sleep(5)


def measure_round(n: int, a, bases: dict[str, Path], levels: list[int], work: Path, emit) -> dict:
    """One round: every model, every server, one after another (logs in work/round-N). {model: {server: result}}."""
    out, work = {}, work / f"round-{n}"
    work.mkdir(exist_ok=True)
    for model in a.model_list:
        if "inprocess" in a.server_list:
            signatures = {model: "serving_default", **({CLASSIFY: "classify"} if model == "wide_deep" else {})}
            for name, signature in signatures.items():
                wait_quiet(emit)
                result = inprocess(model, bases[model], signature, a.seconds)
                out.setdefault(name, {})["inprocess"] = emit(result, round=n, model=name, server="inprocess")
        for server in [s for s in a.server_list if s != "inprocess"]:
            say = functools.partial(emit, round=n, server=server)
            wait_quiet(emit)
            for name, result in serve(server, model, bases[model], a, levels, say, work).items():
                out.setdefault(name, {})[server] = result
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--models", default=",".join(SUITE), help=f"of {', '.join(MODELS)}; wide_deep adds wide_deep_classify"
    )
    ap.add_argument("--servers", default="inprocess,servex,kserve,mlserver")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--models_dir", default=os.path.join(tempfile.gettempdir(), "suite"))
    ap.add_argument("--peers_dir", default=os.environ.get("PEERS_DIR", "/tmp/servex-peers"))
    ap.add_argument("--docs", default="docs", help="where performance-suite.md and img/suite.png go ('' for none)")
    ap.add_argument("--servex_flag", action="append", default=[], help="an extra servex flag (repeatable)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return inprocess_child(json.loads(a.child))
    a.model_list, a.server_list = a.models.split(","), a.servers.split(",")
    levels = sorted(int(c) for c in a.concurrency.split(","))
    bases = export(Path(a.models_dir), a.model_list)
    work = Path(tempfile.mkdtemp(prefix="bench-suite-"))
    print(f"servers' logs: {work}/round-N/SERVER-MODEL.log", flush=True)

    def emit(result: dict, **labels) -> dict:
        print(json.dumps({**labels, **result}), flush=True)
        return result

    started = time.monotonic()
    rounds = [measure_round(n, a, bases, levels, work, emit) for n in range(1, a.rounds + 1)]
    models = [m for m in [*a.model_list, CLASSIFY] if any(m in r for r in rounds)]
    summary = summarize(rounds, models, levels[-1], levels[0])
    for model, s in summary.items():
        print("\n".join(f"{model}: {label}: {verdict(model, k, s)}" for k, (label, _, _) in GOALS.items()))
    if a.docs:
        (docs := Path(a.docs)).mkdir(parents=True, exist_ok=True)
        (docs / "performance-suite.md").write_text(markdown(summary, levels, a, time.monotonic() - started))
        chart(summary, levels, docs / "img" / "suite.png")
        print(f"wrote {docs / 'performance-suite.md'} and {docs / 'img' / 'suite.png'}")


if __name__ == "__main__":
    main()
