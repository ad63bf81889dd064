"""Soak: does servex's memory, file descriptors or threads grow under a long mix of good and bad calls?

    python scripts/soak.py [--minutes 10] [--callers 6] [--reload_every 20] [--servex_flag=--enable_batching]
                           [--tls | --tls=mutual]

Starts servex (on the kit's MLP and TensorFlow Serving's half_plus_two) and keeps ``--callers`` threads sending,
over every API it serves, a mix of answered calls and the failures a client can cause (scripts/soak_traffic.py;
scripts/chaos_soak.py sends them too): unknown models, wrong names, dtypes and shapes, bytes that do not parse, bad
JSON, deadlines too short to meet, calls cancelled while queued or running, streams cut mid-way, shared-memory
regions registered and unregistered. Every ``--reload_every`` seconds it
reloads the model config with or without a second copy of half_plus_two, so versions load and unload throughout.
Every unexpected answer is counted (``unexpected`` in the summary must stay 0), and
so are the tracebacks in servex's log (``log_tracebacks``, 0 too).

The daemon's RSS, open descriptors and threads are sampled every ``--sample_s`` seconds and printed as JSON lines;
the summary compares the end with the end of the first ``--warmup_fraction`` of the run and fits a line through the
samples after it (MB per 100,000 calls). A leak shows as a steady slope; allocator noise as a plateau.

With ``--tls`` servex serves gRPC over TLS (--ssl_config_file, certificates made for the run; ``--tls=mutual``:
client certificates required), every gRPC call goes over it, and callers add handshakes servex must turn away:
plaintext, a server certificate of another CA, and (mutual) no client certificate, each on a new connection.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
from soak_sampling import process_sample, slope_per_100k
from soak_traffic import KIT, Tls, Traffic, call_loop
from tensorflow_serving.apis import model_management_pb2, model_service_pb2_grpc
from tensorflow_serving.config import model_server_config_pb2

from tests.conftest import HALF_PLUS_TWO_TF1
from tests.support.daemon import Daemon, model_config_file


def reload(channel, models: dict[str, Path]) -> str:
    config = model_server_config_pb2.ModelServerConfig()
    config.model_config_list.SetInParent()
    for name, path in models.items():
        config.model_config_list.config.add(name=name, base_path=str(path), model_platform="tensorflow")
    stub = model_service_pb2_grpc.ModelServiceStub(channel)
    reply = stub.HandleReloadConfigRequest(model_management_pb2.ReloadConfigRequest(config=config), timeout=120)
    return "ok" if reply.status.error_code == 0 else f"unexpected reload answer {reply.status}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--callers", type=int, default=6)
    ap.add_argument("--reload_every", type=float, default=20, help="seconds between model-config reloads; 0: none")
    ap.add_argument("--sample_s", type=float, default=10)
    ap.add_argument("--warmup_fraction", type=float, default=0.25)
    ap.add_argument("--only", default="", help="comma-separated call names (Traffic's methods) to send alone")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "servex-bench"))
    ap.add_argument("--servex_flag", action="append", default=[], help="extra servex flag, repeatable")
    ap.add_argument(
        "--tls",
        nargs="?",
        const="server",
        choices=["server", "mutual"],
        default=None,
        help="gRPC over TLS (mutual: client certificates required), and refused handshakes in the mix",
    )
    a = ap.parse_args()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    tls = Tls(work, a.tls == "mutual") if a.tls else None
    tls_flags = [f"--ssl_config_file={tls.config}"] if tls else []
    subprocess.run([sys.executable, str(KIT / "make_models.py"), str(work), "mlp"], check=True, capture_output=True)
    base = {"mlp": work / "mlp", "hp2": Path(HALF_PLUS_TWO_TF1)}
    config = model_config_file(work, base)
    credentials = tls.credentials() if tls else None
    daemon = Daemon([f"--model_config_file={config}", *tls_flags, *a.servex_flag], work, rest=True,
                    credentials=credentials).wait_serving()  # fmt: skip
    only = [n for n in a.only.split(",") if n]
    probe = Traffic(daemon, 0, tls)
    kinds = [c.__name__ for c, _ in probe.calls()]
    probe.close()
    if any(n not in kinds for n in only):
        daemon.stop()
        raise SystemExit(f"--only={a.only}: the kinds of call are {', '.join(kinds)}")
    outcomes: Counter[str] = Counter()
    calls = [0]
    lock = threading.Lock()
    stop = threading.Event()

    def caller(seed: int) -> None:
        traffic = Traffic(daemon, seed, tls)
        mix = [(c, w) for c, w in traffic.calls() if not only or c.__name__ in only]

        def record(name: str, outcome: str, _start: float, _end: float) -> None:
            with lock:
                calls[0] += 1
                if outcome != "ok":
                    outcomes[f"{name}: {outcome}"] += 1

        call_loop(traffic, mix, stop, record)

    def reloader() -> None:
        with_copy = False
        while not stop.wait(a.reload_every):
            with_copy = not with_copy
            models = dict(base, **({"hp2_copy": Path(HALF_PLUS_TWO_TF1)} if with_copy else {}))
            try:
                outcome = reload(daemon.channel, models)
            except grpc.RpcError as e:
                outcome = f"unexpected reload {e.code().name}: {e.details()}"
            with lock:
                outcomes["reloads"] += 1
                if outcome != "ok":
                    outcomes[outcome] += 1

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(a.callers)]
    if a.reload_every > 0:
        threads.append(threading.Thread(target=reloader, daemon=True))
    start = time.monotonic()
    samples = [{"t": 0.0, "calls": 0, **process_sample(daemon.proc.pid)}]
    print(json.dumps(samples[0]), flush=True)
    for t in threads:
        t.start()
    end = start + a.minutes * 60
    try:
        while time.monotonic() < end:
            time.sleep(min(a.sample_s, max(0.0, end - time.monotonic())))
            if daemon.proc.poll() is not None:
                raise SystemExit(f"servex exited with {daemon.proc.returncode}:\n{daemon.log()[-3000:]}")
            with lock:
                done = calls[0]
            sample = {"t": round(time.monotonic() - start, 1), "calls": done, **process_sample(daemon.proc.pid)}
            samples.append(sample)
            print(json.dumps(sample), flush=True)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    after_warmup = [s for s in samples if s["t"] >= a.warmup_fraction * a.minutes * 60] or samples[-1:]
    first, last = after_warmup[0], samples[-1]
    unexpected = {k: v for k, v in outcomes.items() if k != "reloads"}
    summary = {
        "calls": last["calls"],
        "calls_per_s": round(last["calls"] / max(last["t"], 1e-9)),
        "reloads": outcomes["reloads"],
        "unexpected": sum(unexpected.values()),
        "rss_mb": {
            "start": samples[0]["rss_mb"],
            "after_warmup": first["rss_mb"],
            "end": last["rss_mb"],
            "max": max(s["rss_mb"] for s in samples),
        },
        "rss_mb_per_100k_calls_after_warmup": round(
            slope_per_100k([(s["calls"], s["rss_mb"]) for s in after_warmup]), 2
        ),
        "fds": {"after_warmup": first["fds"], "end": last["fds"]},
        "threads": {"after_warmup": first["threads"], "end": last["threads"]},
        "log_tracebacks": daemon.log().count("Traceback"),
        "servex_flags": a.servex_flag,
        "tls": a.tls or "off",
    }
    print(json.dumps({"summary": summary}), flush=True)
    for what, count in sorted(unexpected.items(), key=lambda kv: -kv[1])[:30]:
        print(f"  {count:6d}  {what}", flush=True)
    code = daemon.stop()
    print(json.dumps({"servex_exit_code": code}), flush=True)


if __name__ == "__main__":
    main()
